package dev.railyard.peer.bridge;

import io.vertx.core.AbstractVerticle;
import io.vertx.core.DeploymentOptions;
import io.vertx.core.Promise;
import io.vertx.core.Vertx;
import io.vertx.core.VertxOptions;
import io.vertx.core.eventbus.EventBus;
import io.vertx.core.json.JsonObject;
import io.vertx.ext.bridge.BridgeOptions;
import io.vertx.ext.bridge.PermittedOptions;
import io.vertx.ext.eventbus.bridge.tcp.TcpEventBusBridge;

import java.util.Map;
import java.util.concurrent.TimeUnit;

/**
 * Vert.x's TCP event-bus bridge, configured like the Railyard node the bench runs:
 * inbound {@code railyard.node.echo} (exact) and {@code test\..*} (regex), outbound
 * {@code test\..*}. Services on the bus:
 * <ul>
 *   <li>{@code railyard.node.echo} and {@code test.echo}: reply with the body;</li>
 *   <li>{@code test.fail}: fail with code 42, message "boom";</li>
 *   <li>{@code test.trigger} with body {@code {"to": A}}: send {@code {"n":1}} to A, publish
 *       {@code {"n":2}} to A, request {@code {"n":3}} from A and send A's answer back to A as
 *       {@code {"reply": body}} or {@code {"failed": code, "message": m}}.</li>
 * </ul>
 * One verticle instance per core, each with its own bridge server on the shared port (Vert.x
 * spreads connections over them) and its own echo consumer.
 */
public final class BridgeServer extends AbstractVerticle {

  static final String ECHO = "railyard.node.echo";

  private final int port;

  BridgeServer(int port) {
    this.port = port;
  }

  static void run(Map<String, String> opts) throws Exception {
    int port = Main.intOpt(opts, "port", 7000);
    int instances = Main.intOpt(opts, "instances", Runtime.getRuntime().availableProcessors());
    Vertx vertx = Vertx.vertx(new VertxOptions()
      .setPreferNativeTransport(true)
      .setEventLoopPoolSize(instances)
      // The warning thresholds only log; keep them from spamming under load.
      .setBlockedThreadCheckInterval(10)
      .setBlockedThreadCheckIntervalUnit(TimeUnit.SECONDS));
    System.out.println("native transport: " + vertx.isNativeTransportEnabled());
    vertx.deployVerticle(() -> new BridgeServer(port), new DeploymentOptions().setInstances(instances))
      .toCompletionStage().toCompletableFuture().get(60, TimeUnit.SECONDS);
    System.out.println("LISTENING " + port);
    System.out.flush();
  }

  @Override
  public void start(Promise<Void> started) {
    EventBus eb = vertx.eventBus();
    eb.consumer(ECHO, m -> m.reply(m.body()));
    eb.consumer("test.echo", m -> m.reply(m.body()));
    eb.consumer("test.fail", m -> m.fail(42, "boom"));
    eb.<JsonObject>consumer("test.trigger", m -> {
      String to = m.body().getString("to");
      eb.send(to, new JsonObject().put("n", 1));
      eb.publish(to, new JsonObject().put("n", 2));
      eb.request(to, new JsonObject().put("n", 3), ar -> {
        if (ar.succeeded()) {
          eb.send(to, new JsonObject().put("reply", ar.result().body()));
        } else {
          io.vertx.core.eventbus.ReplyException e = (io.vertx.core.eventbus.ReplyException) ar.cause();
          eb.send(to, new JsonObject().put("failed", e.failureCode()).put("message", e.getMessage()));
        }
      });
    });
    BridgeOptions options = new BridgeOptions()
      .addInboundPermitted(new PermittedOptions().setAddress(ECHO))
      .addInboundPermitted(new PermittedOptions().setAddressRegex("test\\..*"))
      .addOutboundPermitted(new PermittedOptions().setAddressRegex("test\\..*"));
    TcpEventBusBridge.create(vertx, options)
      .listen(port, "127.0.0.1")
      .onSuccess(b -> started.complete())
      .onFailure(started::fail);
  }
}
