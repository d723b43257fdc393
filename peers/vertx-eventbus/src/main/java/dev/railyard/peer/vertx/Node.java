package dev.railyard.peer.vertx;

import io.vertx.core.Future;
import io.vertx.core.Promise;
import io.vertx.core.Vertx;
import io.vertx.core.eventbus.DeliveryOptions;
import io.vertx.core.impl.VertxInternal;
import io.vertx.core.json.JsonArray;
import io.vertx.core.spi.cluster.ClusterManager;
import io.vertx.core.spi.cluster.RegistrationInfo;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * One JVM's part of a run: its Vert.x instance plus what it owns (a private ZooKeeper, the server
 * JVM of a {@code --nodes 2} run), closed in reverse order.
 *
 * <p>Two-node barrier: the driver waits until the server's consumers are visible in the driver's
 * own cluster manager ({@link #awaitRemoteRegistrations}), and, for addresses the driver registers
 * and the server must reach (send-send reply addresses), asks the server over the event bus
 * ({@link #VISIBLE_ADDRESS}) to wait until they are visible there too.
 */
public final class Node implements AutoCloseable {

  /** Server-side consumer: body = JSON array of addresses; replies once each has a remote registration. */
  public static final String VISIBLE_ADDRESS = "railyard.peer.visible";

  private static final long POLL_MS = 20;
  private static final long VISIBILITY_TIMEOUT_MS = 60_000;

  public final Vertx vertx;
  public final NodeOptions options;
  private final ZookeeperServer zookeeper;
  private final ServerProcess server;

  private Node(Vertx vertx, NodeOptions options, ZookeeperServer zookeeper, ServerProcess server) {
    this.vertx = vertx;
    this.options = options;
    this.zookeeper = zookeeper;
    this.server = server;
  }

  /**
   * Starts this JVM's node. A driver of a zookeeper run starts a private ZooKeeper unless
   * {@code --zk-hosts} is given; a driver of a two-node run starts the server JVM (with
   * {@code scenarioArgv} plus the cluster coordinates) and waits until it is ready.
   */
  public static Node start(NodeOptions opts, String scenario, List<String> scenarioArgv) throws Exception {
    ZookeeperServer zk = null;
    ServerProcess server = null;
    Vertx vertx = null;
    try {
      String zkConnect = opts.zkHosts;
      if (opts.cluster == ClusterMode.ZOOKEEPER && zkConnect == null) {
        zk = ZookeeperServer.start();
        zkConnect = zk.connectString();
      }
      if (!opts.server && opts.nodes == 2) {
        List<String> argv = new ArrayList<>(scenarioArgv);
        argv.addAll(opts.serverArgv(opts.cluster == ClusterMode.ZOOKEEPER ? zkConnect : null));
        server = ServerProcess.start(scenario, argv);
      }
      vertx = opts.cluster.start(ClusterMode.benchOptions(), opts, zkConnect);
      if (server != null) {
        server.awaitReady(300, TimeUnit.SECONDS);
        System.out.println("the server JVM is ready");
      }
      return new Node(vertx, opts, zk, server);
    } catch (Exception | Error e) {
      closeQuietly(vertx, server, zk);
      throw e;
    }
  }

  public boolean isTwoNodeDriver() {
    return server != null;
  }

  /** Blocks until {@code address} has at least {@code count} registrations on other nodes. */
  public void awaitRemoteRegistrations(String address, int count) throws Exception {
    long t0 = System.nanoTime();
    pollRemote(vertx, address, count, System.currentTimeMillis() + VISIBILITY_TIMEOUT_MS)
      .toCompletionStage().toCompletableFuture().get(VISIBILITY_TIMEOUT_MS + 10_000, TimeUnit.MILLISECONDS);
    System.out.println(count + " remote registration(s) of '" + address + "' visible after "
      + (System.nanoTime() - t0) / 1_000_000 + " ms");
  }

  /** Blocks until the server JVM sees a registration of each address (made on this node). */
  public void awaitVisibleOnServer(List<String> addresses) throws Exception {
    long t0 = System.nanoTime();
    vertx.eventBus().request(VISIBLE_ADDRESS, new JsonArray(addresses),
        new DeliveryOptions().setSendTimeout(VISIBILITY_TIMEOUT_MS + 5_000))
      .toCompletionStage().toCompletableFuture().get(VISIBILITY_TIMEOUT_MS + 10_000, TimeUnit.MILLISECONDS);
    System.out.println(addresses.size() + " address(es) visible on the server after "
      + (System.nanoTime() - t0) / 1_000_000 + " ms");
  }

  /** Server side: answer {@link #VISIBLE_ADDRESS} probes. */
  public Future<Void> serveVisibilityProbes() {
    Promise<Void> registered = Promise.promise();
    vertx.eventBus().<JsonArray>consumer(VISIBLE_ADDRESS, msg -> {
      long deadline = System.currentTimeMillis() + VISIBILITY_TIMEOUT_MS;
      List<Future<Void>> all = new ArrayList<>();
      for (Object a : msg.body()) {
        all.add(pollRemote(vertx, (String) a, 1, deadline));
      }
      Future.all(all).onComplete(ar -> {
        if (ar.succeeded()) {
          msg.reply("visible");
        } else {
          msg.fail(1, String.valueOf(ar.cause()));
        }
      });
    }).completionHandler(registered);
    return registered.future();
  }

  private static Future<Void> pollRemote(Vertx vertx, String address, int count, long deadlineMs) {
    ClusterManager cm = ((VertxInternal) vertx).getClusterManager();
    Promise<List<RegistrationInfo>> p = Promise.promise();
    cm.getRegistrations(address, p);
    return p.future().compose(list -> {
      int remote = 0;
      for (RegistrationInfo r : list) {
        if (!r.nodeId().equals(cm.getNodeId()) && !r.localOnly()) {
          remote++;
        }
      }
      if (remote >= count) {
        return Future.succeededFuture();
      }
      if (System.currentTimeMillis() > deadlineMs) {
        return Future.failedFuture("only " + remote + " of " + count + " remote registration(s) of '" + address
          + "' became visible in time");
      }
      Promise<Void> again = Promise.promise();
      vertx.setTimer(POLL_MS, id -> pollRemote(vertx, address, count, deadlineMs).onComplete(again));
      return again.future();
    });
  }

  /** Stops the server JVM, then closes Vert.x (leaving the cluster), then the private ZooKeeper. */
  @Override
  public void close() throws Exception {
    closeQuietly(vertx, server, zookeeper);
  }

  private static void closeQuietly(Vertx vertx, ServerProcess server, ZookeeperServer zk) {
    // The server JVM leaves first, while this node is still a member to take over its share of the
    // cluster state, so neither side waits for a dead peer.
    if (server != null) {
      try {
        server.close();
      } catch (Exception e) {
        System.err.println("warning: stopping the server JVM failed: " + e);
      }
    }
    if (vertx != null) {
      try {
        vertx.close().toCompletionStage().toCompletableFuture().get(60, TimeUnit.SECONDS);
      } catch (Exception e) {
        System.err.println("warning: closing Vert.x failed: " + e);
      }
    }
    if (zk != null) {
      try {
        zk.close();
      } catch (Exception e) {
        System.err.println("warning: stopping ZooKeeper failed: " + e);
      }
    }
  }
}
