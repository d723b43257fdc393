package dev.railyard.peer.vertx.echo;

import dev.railyard.peer.vertx.Args;
import dev.railyard.peer.vertx.ClusterMode;
import dev.railyard.peer.vertx.Json;
import dev.railyard.peer.vertx.UsageException;
import io.vertx.core.DeploymentOptions;
import io.vertx.core.Vertx;
import io.vertx.core.eventbus.DeliveryOptions;
import io.vertx.core.json.JsonObject;

import java.util.Set;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Seed 001, "eventbustest": N instances of an echoing tester verticle keep M request chains in
 * flight; the metric is the number of round trips completed inside the measured window.
 */
public final class EchoBench {

  private EchoBench() {
  }

  public static final class Config {
    final double durationS;
    final double warmupS;
    final int instances;
    final int inFlight;
    final boolean localConsumer;
    final boolean localOnlyDelivery;
    final boolean sendSend;
    final ClusterMode cluster;

    private Config(double durationS, double warmupS, int instances, int inFlight, boolean localConsumer,
                   boolean localOnlyDelivery, boolean sendSend, ClusterMode cluster) {
      this.durationS = durationS;
      this.warmupS = warmupS;
      this.instances = instances;
      this.inFlight = inFlight;
      this.localConsumer = localConsumer;
      this.localOnlyDelivery = localOnlyDelivery;
      this.sendSend = sendSend;
      this.cluster = cluster;
    }

    public static Config from(Args args) {
      args.allowOnly(Set.of("duration", "warmup", "instances", "in-flight", "consumer", "delivery", "method",
        "cluster"));
      double duration = args.seconds("duration", 10, 0.001);
      double warmup = args.seconds("warmup", 2, 0);
      long instances = args.positiveLong("instances", 2);
      long inFlight = args.positiveLong("in-flight", 64);
      if (instances > 1024) {
        throw new UsageException("--instances is too large (max 1024)");
      }
      if (inFlight > 1_000_000) {
        throw new UsageException("--in-flight is too large (max 1000000)");
      }
      if (inFlight < instances) {
        throw new UsageException("--in-flight (" + inFlight + ") must be >= --instances (" + instances
          + ") so that every instance drives at least one chain");
      }
      boolean local = args.choice("consumer", "consumer", "consumer", "local").equals("local");
      boolean localOnly = args.choice("delivery", "default", "default", "local-only").equals("local-only");
      boolean sendSend = args.choice("method", "send-reply", "send-reply", "send-send").equals("send-send");
      return new Config(duration, warmup, (int) instances, (int) inFlight, local, localOnly, sendSend,
        ClusterMode.from(args));
    }

    String consumerName() {
      return localConsumer ? "local" : "consumer";
    }

    String deliveryName() {
      return localOnlyDelivery ? "local-only" : "default";
    }

    String methodName() {
      return sendSend ? "send-send" : "send-reply";
    }

    /** Chains driven by instance {@code i}: an even split, the remainder to the first instances. */
    int chainsFor(int i) {
      return inFlight / instances + (i < inFlight % instances ? 1 : 0);
    }

    DeliveryOptions deliveryOptions() {
      return localOnlyDelivery ? new DeliveryOptions().setLocalOnly(true) : new DeliveryOptions();
    }
  }

  /** State shared by the driver thread and the tester instances. */
  static final class Run {
    final Config cfg;
    final long warmupNanos;
    final long windowNanos;
    final EchoTester[] testers;
    final CountDownLatch windowsClosed;

    Run(Config cfg) {
      this.cfg = cfg;
      this.warmupNanos = Math.round(cfg.warmupS * 1e9);
      this.windowNanos = Math.round(cfg.durationS * 1e9);
      this.testers = new EchoTester[cfg.instances];
      this.windowsClosed = new CountDownLatch(cfg.instances);
    }
  }

  public static int run(Config cfg) throws Exception {
    System.out.println("Starting in " + (cfg.cluster == ClusterMode.NONE
      ? "non-clustered mode" : "clustered mode (" + cfg.cluster.wireName() + ")"));
    System.out.println("echo: instances=" + cfg.instances + " in_flight=" + cfg.inFlight
      + " consumer=" + cfg.consumerName() + " delivery=" + cfg.deliveryName() + " method=" + cfg.methodName()
      + " warmup=" + cfg.warmupS + "s duration=" + cfg.durationS + "s");

    Vertx vertx = cfg.cluster.start(ClusterMode.benchOptions());
    Run run = new Run(cfg);
    AtomicInteger nextIndex = new AtomicInteger();

    // Standard (event-loop) verticle, N instances; each start() completes only after all of its
    // consumers (echo + per-chain reply consumers for send-send) have completed registration.
    vertx.deployVerticle(() -> {
        int i = nextIndex.getAndIncrement();
        EchoTester t = new EchoTester(run, i);
        run.testers[i] = t;
        return t;
      }, new DeploymentOptions().setInstances(cfg.instances))
      .toCompletionStage().toCompletableFuture().get(120, TimeUnit.SECONDS);
    System.out.println("deployed " + cfg.instances + " tester instances; starting " + cfg.inFlight + " chains");

    // All chains start together: kick every instance on its own context.
    for (EchoTester t : run.testers) {
      t.kick();
    }

    long boundMs = TimeUnit.NANOSECONDS.toMillis(run.warmupNanos + run.windowNanos) + 120_000;
    if (!run.windowsClosed.await(boundMs, TimeUnit.MILLISECONDS)) {
      throw new IllegalStateException("measurement window did not close in time");
    }

    long roundTrips = 0;
    long failures = 0;
    StringBuilder perInstance = new StringBuilder();
    for (EchoTester t : run.testers) {
      long n = t.windowRoundTrips();
      roundTrips += n;
      failures += t.windowFailures();
      if (perInstance.length() > 0) {
        perInstance.append(", ");
      }
      perInstance.append(n).append(String.format(" in %.3f s", t.windowMeasuredNanos() / 1e9));
    }
    double perSecond = roundTrips / cfg.durationS;
    System.out.println(String.format("%d round trips in %.3f s window = %.0f round trips/s (per instance: %s)%s",
      roundTrips, cfg.durationS, perSecond, perInstance,
      failures > 0 ? " FAILURES in window: " + failures : ""));
    if (failures > 0) {
      System.err.println("warning: " + failures + " round trips failed inside the window (not counted)");
    }

    vertx.close().toCompletionStage().toCompletableFuture().get(60, TimeUnit.SECONDS);

    JsonObject result = new JsonObject()
      .put("scenario", "echo")
      .put("system", "vertx")
      .put("cluster", cfg.cluster.wireName())
      .put("consumer", cfg.consumerName())
      .put("delivery", cfg.deliveryName())
      .put("method", cfg.methodName())
      .put("instances", cfg.instances)
      .put("in_flight", cfg.inFlight)
      .put("duration_s", cfg.durationS)
      .put("warmup_s", cfg.warmupS)
      .put("round_trips", roundTrips)
      .put("round_trips_per_s", perSecond);
    Json.printResult(result);
    return 0;
  }
}
