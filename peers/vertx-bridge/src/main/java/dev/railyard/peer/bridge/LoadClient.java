package dev.railyard.peer.bridge;

import io.vertx.core.Vertx;
import io.vertx.core.VertxOptions;
import io.vertx.core.buffer.Buffer;
import io.vertx.core.json.JsonObject;
import io.vertx.core.net.NetClient;
import io.vertx.core.net.NetClientOptions;
import io.vertx.core.net.NetSocket;
import io.vertx.core.parsetools.RecordParser;

import java.nio.charset.StandardCharsets;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

/**
 * A wire-protocol load client on Vert.x's NetClient: each client keeps one request to
 * {@code railyard.node.echo} in flight and sends the next when the reply frame arrives.
 * Railyard's bench uses its own Rust load client against both servers; this one is for
 * checking the servers from the JVM side.
 */
final class LoadClient {

  private LoadClient() {
  }

  static int run(Map<String, String> opts) throws Exception {
    String host = opts.getOrDefault("host", "127.0.0.1");
    int port = Main.intOpt(opts, "port", 7000);
    int clients = Main.intOpt(opts, "clients", 100);
    double duration = Main.doubleOpt(opts, "duration", 10);
    double warmup = Main.doubleOpt(opts, "warmup", 2);
    Vertx vertx = Vertx.vertx(new VertxOptions().setPreferNativeTransport(true));
    NetClient client = vertx.createNetClient(new NetClientOptions().setTcpNoDelay(true));
    AtomicLong done = new AtomicLong();
    AtomicLong errors = new AtomicLong();
    CountDownLatch connected = new CountDownLatch(clients);
    Buffer request = frame(new JsonObject().put("type", "send").put("address", BridgeServer.ECHO)
      .put("replyAddress", "r").put("body", new JsonObject().put("payload", "hello")));
    for (int i = 0; i < clients; i++) {
      client.connect(port, host).onSuccess(socket -> {
        drive(socket, request, done, errors);
        connected.countDown();
      }).onFailure(t -> {
        errors.incrementAndGet();
        connected.countDown();
      });
    }
    if (!connected.await(60, TimeUnit.SECONDS)) {
      throw new IllegalStateException("clients did not connect within 60 s");
    }
    Thread.sleep((long) (warmup * 1000));
    long start = done.get();
    long errStart = errors.get();
    long t0 = System.nanoTime();
    Thread.sleep((long) (duration * 1000));
    long roundTrips = done.get() - start;
    double secs = (System.nanoTime() - t0) / 1e9;
    JsonObject result = new JsonObject()
      .put("scenario", "bridge").put("system", "vertx-client").put("clients", clients)
      .put("duration_s", secs).put("round_trips", roundTrips)
      .put("round_trips_per_s", roundTrips / secs).put("errors", errors.get() - errStart);
    System.out.println("RESULT " + result.encode());
    vertx.close();
    return 0;
  }

  private static void drive(NetSocket socket, Buffer request, AtomicLong done, AtomicLong errors) {
    RecordParser parser = RecordParser.newFixed(4);
    parser.handler(new io.vertx.core.Handler<Buffer>() {
      boolean header = true;

      @Override
      public void handle(Buffer b) {
        if (header) {
          parser.fixedSizeMode(b.getInt(0));
          header = false;
        } else {
          parser.fixedSizeMode(4);
          header = true;
          if (b.getString(0, Math.min(b.length(), 16), "UTF-8").contains("\"err\"")) {
            errors.incrementAndGet();
          } else {
            done.incrementAndGet();
          }
          socket.write(request);
        }
      }
    });
    socket.handler(parser);
    socket.write(request);
  }

  private static Buffer frame(JsonObject o) {
    byte[] bytes = o.encode().getBytes(StandardCharsets.UTF_8);
    return Buffer.buffer(bytes.length + 4).appendInt(bytes.length).appendBytes(bytes);
  }
}
