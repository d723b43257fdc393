package dev.railyard.peer.vertx;

import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Set;
import java.util.UUID;

/**
 * The options every scenario shares: which cluster manager, how many JVMs, this JVM's role, and
 * (internal, set by the driver for its server JVM) where the cluster lives.
 *
 * <pre>
 * --cluster none|hazelcast|infinispan|zookeeper   (default none)
 * --nodes 1|2                                     (default 1; 2 needs a cluster manager)
 * --role driver|server                            (default driver; server = the second JVM)
 * --zk-hosts HOST:PORT[,...]                      (zookeeper only: use this server instead of
 *                                                  starting a private one)
 * --cluster-name NAME --cluster-port P --cluster-ports P1,P2   (internal: driver -> server)
 * </pre>
 */
public final class NodeOptions {

  /** Option names handled here; each scenario accepts these on top of its own. */
  public static final Set<String> NAMES = Set.of("cluster", "nodes", "role", "zk-hosts", "cluster-name",
    "cluster-port", "cluster-ports");

  public final ClusterMode cluster;
  public final int nodes;
  public final boolean server;
  /** Hazelcast cluster name, unique per run so concurrent runs on this machine never merge. */
  public final String clusterName;
  /** This node's Hazelcast / JGroups member port on 127.0.0.1. */
  public final int clusterPort;
  /** Every member's port (this node's included), the static TCP member list. */
  public final List<Integer> clusterPorts;
  /** ZooKeeper connect string, or null: the driver starts a private server. */
  public final String zkHosts;

  private NodeOptions(ClusterMode cluster, int nodes, boolean server, String clusterName, int clusterPort,
                      List<Integer> clusterPorts, String zkHosts) {
    this.cluster = cluster;
    this.nodes = nodes;
    this.server = server;
    this.clusterName = clusterName;
    this.clusterPort = clusterPort;
    this.clusterPorts = clusterPorts;
    this.zkHosts = zkHosts;
  }

  public static NodeOptions from(Args args) {
    ClusterMode cluster = ClusterMode.from(args);
    int nodes = Integer.parseInt(args.choice("nodes", "1", "1", "2"));
    boolean server = args.choice("role", "driver", "driver", "server").equals("server");
    if (nodes == 2 && cluster == ClusterMode.NONE) {
      throw new UsageException("--nodes 2 needs a cluster manager: --cluster hazelcast|infinispan|zookeeper");
    }
    if (server && nodes != 2) {
      throw new UsageException("--role server is the second JVM of a --nodes 2 run");
    }
    String zkHosts = args.string("zk-hosts", null);
    if (zkHosts != null && cluster != ClusterMode.ZOOKEEPER) {
      throw new UsageException("--zk-hosts only applies to --cluster zookeeper");
    }
    if (server && cluster == ClusterMode.ZOOKEEPER && zkHosts == null) {
      throw new UsageException("--role server with --cluster zookeeper needs --zk-hosts");
    }

    String name = args.string("cluster-name", null);
    String port = args.string("cluster-port", null);
    String ports = args.string("cluster-ports", null);
    boolean internalGiven = name != null || port != null || ports != null;
    if (server && (name == null || port == null || ports == null)) {
      throw new UsageException("--role server needs --cluster-name, --cluster-port and --cluster-ports"
        + " (the driver passes them; run the driver with --nodes 2 instead of starting a server by hand)");
    }
    if (!server && internalGiven) {
      throw new UsageException("--cluster-name/--cluster-port/--cluster-ports are internal to --role server");
    }
    if (!server) {
      // The driver plans the whole cluster: one free loopback port per member.
      List<Integer> planned = new ArrayList<>();
      for (int i = 0; i < nodes; i++) {
        planned.add(FreePort.pick(planned));
      }
      return new NodeOptions(cluster, nodes, false, "railyard-" + UUID.randomUUID(), planned.get(0),
        Collections.unmodifiableList(planned), zkHosts);
    }
    List<Integer> memberPorts = new ArrayList<>();
    for (String p : ports.split(",")) {
      memberPorts.add(parsePort("cluster-ports", p));
    }
    int own = parsePort("cluster-port", port);
    if (!memberPorts.contains(own)) {
      throw new UsageException("--cluster-port " + own + " is not in --cluster-ports " + ports);
    }
    return new NodeOptions(cluster, nodes, true, name, own, Collections.unmodifiableList(memberPorts), zkHosts);
  }

  private static int parsePort(String option, String v) {
    try {
      int p = Integer.parseInt(v.trim());
      if (p > 0 && p < 65536) {
        return p;
      }
    } catch (NumberFormatException e) {
      // reported below
    }
    throw new UsageException("--" + option + ": not a port: '" + v + "'");
  }

  /** The member port the server JVM of a two-node run uses. */
  public int serverPort() {
    return clusterPorts.get(1);
  }

  /** The options the driver passes to its server JVM, on top of the scenario's own. */
  public List<String> serverArgv(String zkConnect) {
    List<String> argv = new ArrayList<>(List.of("--cluster", cluster.wireName(), "--nodes", "2", "--role", "server",
      "--cluster-name", clusterName, "--cluster-port", Integer.toString(serverPort()), "--cluster-ports",
      joinPorts()));
    if (zkConnect != null) {
      argv.add("--zk-hosts");
      argv.add(zkConnect);
    }
    return argv;
  }

  String joinPorts() {
    StringBuilder sb = new StringBuilder();
    for (Integer p : clusterPorts) {
      if (sb.length() > 0) {
        sb.append(',');
      }
      sb.append(p);
    }
    return sb.toString();
  }
}
