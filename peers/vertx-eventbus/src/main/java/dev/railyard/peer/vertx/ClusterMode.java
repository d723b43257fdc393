package dev.railyard.peer.vertx;

import com.hazelcast.config.Config;
import com.hazelcast.config.JoinConfig;
import com.hazelcast.config.NetworkConfig;
import io.vertx.core.Vertx;
import io.vertx.core.VertxOptions;
import io.vertx.core.json.JsonObject;
import io.vertx.ext.cluster.infinispan.InfinispanClusterManager;
import io.vertx.spi.cluster.hazelcast.ConfigUtil;
import io.vertx.spi.cluster.hazelcast.HazelcastClusterManager;
import io.vertx.spi.cluster.zookeeper.ZookeeperClusterManager;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * How the Vert.x instance is created: {@code --cluster none|hazelcast|infinispan|zookeeper}.
 *
 * <p>Each cluster manager runs with its Vert.x default configuration (the {@code default-*.xml} /
 * {@code default-zookeeper.json} shipped in its jar) with exactly one change: discovery is confined
 * to this machine. Hazelcast: TCP-IP join on an explicit 127.0.0.1 member list, multicast and
 * auto-detection off, interface 127.0.0.1, phone-home off. Infinispan: the default JGroups TCP stack
 * bound to 127.0.0.1 with TCPPING on the member list instead of MPING (multicast), see
 * {@code railyard-jgroups-loopback.xml}. Zookeeper: the server given by {@code --zk-hosts}, or a
 * private one on loopback started by {@link ZookeeperServer}. The clustered event bus itself listens
 * on 127.0.0.1 on an OS-chosen port.
 *
 * <p>The scenarios only ever see the resulting {@link Vertx}, and report {@link #wireName()} in
 * their RESULT line.
 */
public enum ClusterMode {
  NONE("none"),
  HAZELCAST("hazelcast"),
  INFINISPAN("infinispan"),
  ZOOKEEPER("zookeeper");

  static final String LOOPBACK = "127.0.0.1";

  private final String wireName;

  ClusterMode(String wireName) {
    this.wireName = wireName;
  }

  public String wireName() {
    return wireName;
  }

  /** Parses {@code --cluster}. */
  public static ClusterMode from(Args args) {
    String v = args.string("cluster", "none");
    for (ClusterMode m : values()) {
      if (m.wireName.equals(v)) {
        return m;
      }
    }
    throw new UsageException("--cluster must be one of none|hazelcast|infinispan|zookeeper, got '" + v + "'");
  }

  /**
   * Creates the Vert.x instance for this mode, blocking until it is ready (for a clustered mode:
   * until it has joined the cluster).
   *
   * @param zkConnect the ZooKeeper connect string (zookeeper mode only)
   */
  public Vertx start(VertxOptions options, NodeOptions node, String zkConnect) throws Exception {
    if (this == NONE) {
      Vertx vertx = Vertx.vertx(options);
      printVersion(vertx);
      return vertx;
    }
    options.getEventBusOptions()
      .setHost(LOOPBACK)
      .setPort(0)
      .setClusterPublicHost(LOOPBACK);
    switch (this) {
      case HAZELCAST:
        options.setClusterManager(new HazelcastClusterManager(hazelcastConfig(node)));
        break;
      case INFINISPAN:
        // Read by InfinispanClusterManager's default constructor and by the JGroups stack file.
        System.setProperty("vertx.jgroups.config", "railyard-jgroups-loopback.xml");
        System.setProperty("railyard.jgroups.port", Integer.toString(node.clusterPort));
        System.setProperty("railyard.jgroups.hosts", members(node, "%s[%d]"));
        options.setClusterManager(new InfinispanClusterManager());
        break;
      case ZOOKEEPER:
        options.setClusterManager(new ZookeeperClusterManager(zookeeperConfig(zkConnect)));
        break;
      default:
        throw new IllegalStateException(wireName);
    }
    long t0 = System.nanoTime();
    Vertx vertx = Vertx.clusteredVertx(options).toCompletionStage().toCompletableFuture().get(180, TimeUnit.SECONDS);
    printVersion(vertx);
    System.out.println("joined the " + wireName + " cluster in " + (System.nanoTime() - t0) / 1_000_000 + " ms");
    return vertx;
  }

  private static void printVersion(Vertx vertx) {
    System.out.println("Vert.x " + io.vertx.core.impl.launcher.commands.VersionCommand.getVersion()
      + ", transport: " + (vertx.isNativeTransportEnabled() ? "native" : "nio"));
  }

  private static String members(NodeOptions node, String format) {
    List<String> list = new ArrayList<>();
    for (Integer p : node.clusterPorts) {
      list.add(String.format(format, LOOPBACK, p));
    }
    return String.join(",", list);
  }

  /** vertx-hazelcast's own default config (default-cluster.xml), discovery confined to loopback. */
  static Config hazelcastConfig(NodeOptions node) {
    Config hz = ConfigUtil.loadConfig();
    hz.setClusterName(node.clusterName);
    hz.setProperty("hazelcast.phone.home.enabled", "false");
    hz.setProperty("hazelcast.socket.bind.any", "false");
    NetworkConfig net = hz.getNetworkConfig();
    net.setPort(node.clusterPort).setPortAutoIncrement(false).setPortCount(1);
    net.getInterfaces().setEnabled(true).setInterfaces(List.of(LOOPBACK));
    JoinConfig join = net.getJoin();
    join.getMulticastConfig().setEnabled(false);
    join.getAutoDetectionConfig().setEnabled(false);
    join.getTcpIpConfig().setEnabled(true).setMembers(List.of(members(node, "%s:%d").split(",")));
    return hz;
  }

  /** vertx-zookeeper's default-zookeeper.json with the connect string replaced. */
  static JsonObject zookeeperConfig(String zkConnect) {
    return new JsonObject()
      .put("zookeeperHosts", zkConnect)
      .put("sessionTimeout", 20000)
      .put("connectTimeout", 3000)
      .put("rootPath", "io.vertx")
      .put("retry", new JsonObject()
        .put("policy", "exponential_backoff")
        .put("initialSleepTime", 100)
        .put("intervalTimes", 10000)
        .put("maxTimes", 5));
  }

  /** Shared Vert.x settings for both scenarios. */
  public static VertxOptions benchOptions() {
    VertxOptions options = new VertxOptions();
    // Vert.x's default pool is 2 event loops per core; -Drailyard.eventLoops=N sets it (e.g. one
    // loop per JVM when two JVMs share the cores).
    String loops = System.getProperty("railyard.eventLoops");
    if (loops != null && !loops.isEmpty()) {
      options.setEventLoopPoolSize(Integer.parseInt(loops));
    }
    return options
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
