package dev.railyard.peer.vertx.pingpong;

import dev.railyard.peer.vertx.Args;
import dev.railyard.peer.vertx.ClusterMode;
import dev.railyard.peer.vertx.Json;
import dev.railyard.peer.vertx.UsageException;
import io.vertx.core.DeploymentOptions;
import io.vertx.core.ThreadingModel;
import io.vertx.core.Vertx;
import io.vertx.core.json.JsonObject;

import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;

/**
 * Seed 000, "vertx-cluster-performance": a worker consumer that replies, and a worker producer
 * that fires N requests with reply handlers and times the replies.
 */
public final class PingPongBench {

  private PingPongBench() {
  }

  public static final class Config {
    final int messages;
    final ClusterMode cluster;

    private Config(int messages, ClusterMode cluster) {
      this.messages = messages;
      this.cluster = cluster;
    }

    public static Config from(Args args) {
      args.allowOnly(Set.of("messages", "cluster"));
      long n = args.positiveLong("messages", 500_000);
      if (n > Integer.MAX_VALUE) {
        throw new UsageException("--messages is too large");
      }
      return new Config((int) n, ClusterMode.from(args));
    }
  }

  static final class Outcome {
    final long firstReplyMs;
    final long allRepliesMs;
    final long failures;

    Outcome(long firstReplyMs, long allRepliesMs, long failures) {
      this.firstReplyMs = firstReplyMs;
      this.allRepliesMs = allRepliesMs;
      this.failures = failures;
    }
  }

  static long msSince(long startNanos) {
    return (System.nanoTime() - startNanos) / 1_000_000;
  }

  public static int run(Config cfg) throws Exception {
    System.out.println(cfg.cluster == ClusterMode.NONE
      ? "Starting in non-clustered mode"
      : "Starting in clustered mode (" + cfg.cluster.wireName() + ")");
    Vertx vertx = cfg.cluster.start(ClusterMode.benchOptions());
    CompletableFuture<Outcome> outcome = new CompletableFuture<>();
    DeploymentOptions worker = new DeploymentOptions().setThreadingModel(ThreadingModel.WORKER);

    // Deploy the producer only once the consumer's registration completion handler has fired
    // (ConsumerVerticle completes its start promise from there).
    vertx.deployVerticle(new ConsumerVerticle(), worker)
      .compose(id -> vertx.deployVerticle(new ProducerVerticle(cfg.messages, outcome), worker))
      .onFailure(outcome::completeExceptionally);

    // Generous bound: the requests themselves time out after 60 s.
    Outcome o = outcome.get(ProducerVerticle.REQUEST_TIMEOUT_MS + 600_000, TimeUnit.MILLISECONDS);
    vertx.close().toCompletionStage().toCompletableFuture().get(60, TimeUnit.SECONDS);

    JsonObject result = new JsonObject()
      .put("scenario", "pingpong")
      .put("system", "vertx")
      .put("cluster", cfg.cluster.wireName())
      .put("messages", cfg.messages)
      .put("first_reply_ms", o.firstReplyMs)
      .put("all_replies_ms", o.allRepliesMs)
      .put("failures", o.failures);
    Json.printResult(result);
    return 0;
  }
}
