package dev.railyard.peer.vertx;

import io.vertx.core.Vertx;
import io.vertx.core.VertxOptions;

import java.util.concurrent.TimeUnit;

/**
 * How the Vert.x instance is created: {@code --cluster none|hazelcast|infinispan|zookeeper}.
 *
 * <p>Only {@link #NONE} is built in today. Adding a cluster manager later is meant to be local to
 * this class: add the {@code io.vertx:vertx-<name>} dependency to pom.xml, set the manager on the
 * options in {@link #start(VertxOptions)} and use {@code Vertx.clusteredVertx(options)}. The
 * scenarios only ever see the resulting {@link Vertx}, and report {@link #wireName()} in their
 * RESULT line.
 */
public enum ClusterMode {
  NONE("none"),
  HAZELCAST("hazelcast"),
  INFINISPAN("infinispan"),
  ZOOKEEPER("zookeeper");

  private final String wireName;

  ClusterMode(String wireName) {
    this.wireName = wireName;
  }

  public String wireName() {
    return wireName;
  }

  /** Parses {@code --cluster}; rejects (exit 2) anything but {@code none} for now. */
  public static ClusterMode from(Args args) {
    String v = args.string("cluster", "none");
    for (ClusterMode m : values()) {
      if (m.wireName.equals(v)) {
        if (m != NONE) {
          throw new UsageException("--cluster " + v + " is not supported by this build of the peer yet"
            + " (no cluster manager is bundled); only --cluster none is available");
        }
        return m;
      }
    }
    throw new UsageException("--cluster must be one of none|hazelcast|infinispan|zookeeper, got '" + v + "'");
  }

  /** Creates the Vert.x instance for this mode, blocking until it is ready. */
  public Vertx start(VertxOptions options) throws Exception {
    switch (this) {
      case NONE: {
        Vertx vertx = Vertx.vertx(options);
        System.out.println("Vert.x " + io.vertx.core.impl.launcher.commands.VersionCommand.getVersion()
          + ", transport: " + (vertx.isNativeTransportEnabled() ? "native" : "nio"));
        return vertx;
      }
      default:
        // Unreachable while from() rejects the clustered modes; kept explicit for the follow-up.
        // Later: options.setClusterManager(new XxxClusterManager());
        //        return Vertx.clusteredVertx(options).toCompletionStage().toCompletableFuture().get(...);
        throw new UsageException("--cluster " + wireName + " is not supported yet");
    }
  }

  /** Shared Vert.x settings for both scenarios. */
  public static VertxOptions benchOptions() {
    return new VertxOptions()
      // The pingpong producer legitimately loops for seconds inside a worker's start(), exactly
      // like the original. Check rarely and only complain about really stuck threads, so the
      // checker neither spams stderr nor costs anything noticeable.
      .setBlockedThreadCheckInterval(10)
      .setBlockedThreadCheckIntervalUnit(TimeUnit.SECONDS)
      .setMaxEventLoopExecuteTime(10)
      .setMaxEventLoopExecuteTimeUnit(TimeUnit.SECONDS)
      .setMaxWorkerExecuteTime(120)
      .setMaxWorkerExecuteTimeUnit(TimeUnit.SECONDS)
      .setWarningExceptionTime(120)
      .setWarningExceptionTimeUnit(TimeUnit.SECONDS);
  }
}
