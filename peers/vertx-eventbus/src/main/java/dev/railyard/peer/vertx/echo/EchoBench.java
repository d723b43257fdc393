package dev.railyard.peer.vertx.echo;

import dev.railyard.peer.vertx.Args;
import dev.railyard.peer.vertx.ClusterMode;
import dev.railyard.peer.vertx.Json;
import dev.railyard.peer.vertx.Node;
import dev.railyard.peer.vertx.NodeOptions;
import dev.railyard.peer.vertx.ServerProcess;
import dev.railyard.peer.vertx.UsageException;
import io.vertx.core.DeploymentOptions;
import io.vertx.core.Vertx;
import io.vertx.core.eventbus.DeliveryOptions;
import io.vertx.core.json.JsonObject;

import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
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
    final NodeOptions node;
    final ClusterMode cluster;
    /** The scenario's own options, passed on to the server JVM of a two-node run. */
    final List<String> scenarioArgv;

    private Config(double durationS, double warmupS, int instances, int inFlight, boolean localConsumer,
                   boolean localOnlyDelivery, boolean sendSend, NodeOptions node, List<String> scenarioArgv) {
      this.durationS = durationS;
      this.warmupS = warmupS;
      this.instances = instances;
      this.inFlight = inFlight;
      this.localConsumer = localConsumer;
      this.localOnlyDelivery = localOnlyDelivery;
      this.sendSend = sendSend;
      this.node = node;
      this.cluster = node.cluster;
      this.scenarioArgv = scenarioArgv;
    }

    public static Config from(Args args) {
      Set<String> allowed = new HashSet<>(NodeOptions.NAMES);
      allowed.addAll(Set.of("duration", "warmup", "instances", "in-flight", "consumer", "delivery", "method"));
      args.allowOnly(allowed);
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
      NodeOptions node = NodeOptions.from(args);
      if (node.nodes == 2 && (local || localOnly)) {
        throw new UsageException("--nodes 2 puts the echo consumers in the second JVM, which only a clustered"
          + " consumer with default delivery options can reach: use --consumer consumer --delivery default");
      }
      return new Config(duration, warmup, (int) instances, (int) inFlight, local, localOnly, sendSend, node,
        args.toArgv(NodeOptions.NAMES));
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

  /** Which side of the experiment a tester instance runs. */
  enum Part {
    /** One JVM: the echo consumer and the chains (seed 001). */
    ALL,
    /** Two-node driver: the chains (and, for send-send, their reply consumers) only. */
    CHAINS,
    /** Two-node server: the echo consumer only. */
    ECHO
  }

  /** State shared by the driver thread and the tester instances. */
  static final class Run {
    final Config cfg;
    final Part part;
    final long warmupNanos;
    final long windowNanos;
    final EchoTester[] testers;
    final CountDownLatch windowsClosed;

    Run(Config cfg, Part part) {
      this.cfg = cfg;
      this.part = part;
      this.warmupNanos = Math.round(cfg.warmupS * 1e9);
      this.windowNanos = Math.round(cfg.durationS * 1e9);
      this.testers = new EchoTester[cfg.instances];
      this.windowsClosed = new CountDownLatch(cfg.instances);
    }
  }

  public static int run(Config cfg) throws Exception {
    System.out.println("Starting in " + (cfg.cluster == ClusterMode.NONE
      ? "non-clustered mode" : "clustered mode (" + cfg.cluster.wireName() + (cfg.node.nodes == 2
        ? ", two JVMs, this one is the " + (cfg.node.server ? "server: echo consumers" : "driver: chains") : "")
        + ")"));
    System.out.println("echo: instances=" + cfg.instances + " in_flight=" + cfg.inFlight
      + " consumer=" + cfg.consumerName() + " delivery=" + cfg.deliveryName() + " method=" + cfg.methodName()
      + " warmup=" + cfg.warmupS + "s duration=" + cfg.durationS + "s");

    Measured measured = new Measured(0, 0.0, 0);
    try (Node node = Node.start(cfg.node, "echo", cfg.scenarioArgv)) {
      Vertx vertx = node.vertx;
      Part part = cfg.node.server ? Part.ECHO : node.isTwoNodeDriver() ? Part.CHAINS : Part.ALL;
      Run run = new Run(cfg, part);
      if (part == Part.CHAINS) {
        // The echo consumers live in the server JVM: wait until all of them are visible here.
        node.awaitRemoteRegistrations(EchoTester.ECHO_ADDRESS, cfg.instances);
      }
      deploy(vertx, run);
      if (part == Part.ECHO) {
        node.serveVisibilityProbes().toCompletionStage().toCompletableFuture().get(120, TimeUnit.SECONDS);
        System.out.println("deployed " + cfg.instances + " echo instances");
        ServerProcess.serveUntilStopped();
        return 0;
      }
      if (part == Part.CHAINS && cfg.sendSend) {
        // The server's echoers send to this JVM's reply consumers: wait until it sees them all.
        List<String> replyAddresses = new ArrayList<>();
        for (int i = 0; i < cfg.instances; i++) {
          for (int c = 0; c < cfg.chainsFor(i); c++) {
            replyAddresses.add(EchoTester.replyAddress(i, c));
          }
        }
        node.awaitVisibleOnServer(replyAddresses);
      }
      System.out.println("deployed " + cfg.instances + " tester instances; starting " + cfg.inFlight + " chains");
      measured = measure(run);
    }

    long roundTrips = measured.roundTrips();
    double perSecond = measured.perSecond();
    JsonObject result = new JsonObject()
      .put("scenario", "echo")
      .put("system", "vertx")
      .put("cluster", cfg.cluster.wireName())
      .put("nodes", cfg.node.nodes)
      .put("consumer", cfg.consumerName())
      .put("delivery", cfg.deliveryName())
      .put("method", cfg.methodName())
      .put("instances", cfg.instances)
      .put("in_flight", cfg.inFlight)
      .put("duration_s", cfg.durationS)
      .put("warmup_s", cfg.warmupS)
      .put("round_trips", roundTrips)
      .put("round_trips_per_s", perSecond)
      .put("failures", measured.failures());
    Json.printResult(result);
    return 0;
  }

  /**
   * Standard (event-loop) verticle, N instances; each start() completes only after all of its
   * consumers (echo and/or per-chain reply consumers for send-send) have completed registration.
   */
  private static void deploy(Vertx vertx, Run run) throws Exception {
    AtomicInteger nextIndex = new AtomicInteger();
    vertx.deployVerticle(() -> {
        int i = nextIndex.getAndIncrement();
        EchoTester t = new EchoTester(run, i);
        run.testers[i] = t;
        return t;
      }, new DeploymentOptions().setInstances(run.cfg.instances))
      .toCompletionStage().toCompletableFuture().get(120, TimeUnit.SECONDS);
  }

  /** Starts all chains together, waits for every instance's window to close, returns the sum. */
  /** Round trips in the windows, and their rate: each instance's count over its own measured window, summed. */
  /** Failures: failed or mismatched round trips inside the window (not counted as round trips). */
  private record Measured(long roundTrips, double perSecond, long failures) {}

  private static Measured measure(Run run) throws Exception {
    Config cfg = run.cfg;
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
    // Each instance's rate over the window it measured (its timers fire a little late or early),
    // as Railyard divides by its measured window, not the nominal duration.
    double perSecond = 0.0;
    StringBuilder perInstance = new StringBuilder();
    for (EchoTester t : run.testers) {
      long n = t.windowRoundTrips();
      roundTrips += n;
      perSecond += n / (Math.max(1L, t.windowMeasuredNanos()) / 1e9);
      failures += t.windowFailures();
      if (perInstance.length() > 0) {
        perInstance.append(", ");
      }
      perInstance.append(n).append(String.format(" in %.3f s", t.windowMeasuredNanos() / 1e9));
    }
    System.out.println(String.format("%d round trips in %.3f s window = %.0f round trips/s (per instance: %s)%s",
      roundTrips, cfg.durationS, perSecond, perInstance,
      failures > 0 ? " FAILURES in window: " + failures : ""));
    if (failures > 0) {
      System.err.println("warning: " + failures + " round trips failed inside the window (not counted)");
    }
    return new Measured(roundTrips, perSecond, failures);
  }
}
