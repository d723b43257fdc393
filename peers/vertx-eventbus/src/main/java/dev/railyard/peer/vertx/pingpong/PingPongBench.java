package dev.railyard.peer.vertx.pingpong;

import dev.railyard.peer.vertx.Args;
import dev.railyard.peer.vertx.ClusterMode;
import dev.railyard.peer.vertx.Json;
import dev.railyard.peer.vertx.Node;
import dev.railyard.peer.vertx.NodeOptions;
import dev.railyard.peer.vertx.ServerProcess;
import dev.railyard.peer.vertx.UsageException;
import io.vertx.core.DeploymentOptions;
import io.vertx.core.ThreadingModel;
import io.vertx.core.Vertx;
import io.vertx.core.json.JsonObject;

import java.util.HashSet;
import java.util.List;
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
    final NodeOptions node;
    /** The scenario's own options, passed on to the server JVM of a two-node run. */
    final List<String> scenarioArgv;

    private Config(int messages, NodeOptions node, List<String> scenarioArgv) {
      this.messages = messages;
      this.node = node;
      this.scenarioArgv = scenarioArgv;
    }

    public static Config from(Args args) {
      Set<String> allowed = new HashSet<>(NodeOptions.NAMES);
      allowed.add("messages");
      args.allowOnly(allowed);
      long n = args.positiveLong("messages", 500_000);
      if (n > Integer.MAX_VALUE) {
        throw new UsageException("--messages is too large");
      }
      return new Config((int) n, NodeOptions.from(args), args.toArgv(NodeOptions.NAMES));
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
    ClusterMode cluster = cfg.node.cluster;
    System.out.println(cluster == ClusterMode.NONE
      ? "Starting in non-clustered mode"
      : "Starting in clustered mode (" + cluster.wireName() + (cfg.node.nodes == 2
        ? ", two JVMs, this one is the " + (cfg.node.server ? "server: consumer" : "driver: producer") : "")
        + ")");
    DeploymentOptions worker = new DeploymentOptions().setThreadingModel(ThreadingModel.WORKER);
    Outcome o;
    try (Node node = Node.start(cfg.node, "pingpong", cfg.scenarioArgv)) {
      Vertx vertx = node.vertx;
      if (cfg.node.server) {
        // The second JVM: only the consumer; the driver's producer reaches it over the cluster.
        vertx.deployVerticle(new ConsumerVerticle(), worker)
          .toCompletionStage().toCompletableFuture().get(120, TimeUnit.SECONDS);
        ServerProcess.serveUntilStopped();
        return 0;
      }
      CompletableFuture<Outcome> outcome = new CompletableFuture<>();
      if (node.isTwoNodeDriver()) {
        // The consumer lives in the server JVM: start the producer once its registration is
        // visible here.
        node.awaitRemoteRegistrations(ConsumerVerticle.ADDRESS, 1);
        vertx.deployVerticle(new ProducerVerticle(cfg.messages, outcome), worker)
          .onFailure(outcome::completeExceptionally);
      } else {
        // Deploy the producer only once the consumer's registration completion handler has fired
        // (ConsumerVerticle completes its start promise from there).
        vertx.deployVerticle(new ConsumerVerticle(), worker)
          .compose(id -> vertx.deployVerticle(new ProducerVerticle(cfg.messages, outcome), worker))
          .onFailure(outcome::completeExceptionally);
      }
      // Generous bound: the requests themselves time out after 60 s.
      o = outcome.get(ProducerVerticle.REQUEST_TIMEOUT_MS + 600_000, TimeUnit.MILLISECONDS);
    }

    JsonObject result = new JsonObject()
      .put("scenario", "pingpong")
      .put("system", "vertx")
      .put("cluster", cluster.wireName())
      .put("nodes", cfg.node.nodes)
      .put("messages", cfg.messages)
      .put("first_reply_ms", o.firstReplyMs)
      .put("all_replies_ms", o.allRepliesMs)
      .put("failures", o.failures);
    Json.printResult(result);
    return 0;
  }
}
