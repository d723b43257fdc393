package dev.railyard.peer.c10k;

import com.github.benmanes.caffeine.cache.Caffeine;
import com.github.benmanes.caffeine.cache.LoadingCache;
import io.vertx.core.AbstractVerticle;
import io.vertx.core.Promise;
import io.vertx.core.buffer.Buffer;
import io.vertx.core.http.HttpMethod;
import io.vertx.core.http.HttpServer;
import io.vertx.core.http.HttpServerOptions;
import io.vertx.ext.web.Router;
import io.vertx.ext.web.handler.BodyHandler;
import org.apache.commons.lang3.RandomStringUtils;

import java.util.concurrent.ThreadLocalRandom;

/**
 * The seed's HTTP verticle: the same server options and routes. Fixed bodies are random
 * alphanumeric strings made at start; cached bodies come from Caffeine caches (maximum
 * 10,000 entries, random key in 0..5000 per request); /sendFile/test uses Vert.x's
 * sendFile (sendfile(2) on the native transport); /upload takes a multipart body through
 * BodyHandler.
 */
public final class ServerVerticle extends AbstractVerticle {

  static final int N4K = 4 * 1024;
  static final int N8K = 8 * 1024;
  static final int N64K = 64 * 1024;
  static final int MAX_RANGE = 5000;

  static final LoadingCache<Integer, Buffer> CACHE_4K = cache(N4K);
  static final LoadingCache<Integer, Buffer> CACHE_8K = cache(N8K);
  static final LoadingCache<Integer, Buffer> CACHE_64K = cache(N64K);

  private final Main.Config cfg;
  private HttpServer server;

  ServerVerticle(Main.Config cfg) {
    this.cfg = cfg;
  }

  private static LoadingCache<Integer, Buffer> cache(int len) {
    return Caffeine.newBuilder().maximumSize(10_000).build(key -> createBuffer(len));
  }

  @Override
  public void start(Promise<Void> startPromise) {
    HttpServerOptions options = new HttpServerOptions()
      .setPort(cfg.port)
      .setHost(cfg.host)
      .setCompressionSupported(true)
      .setHandle100ContinueAutomatically(true)
      .setTcpFastOpen(true)
      .setTcpNoDelay(true)
      .setTcpQuickAck(true);
    server = vertx.createHttpServer(options);
    server.requestHandler(createRouter());
    server.listen().onComplete(ar -> {
      if (ar.failed()) {
        startPromise.fail(ar.cause());
      } else {
        startPromise.complete();
      }
    });
  }

  @Override
  public void stop(Promise<Void> stopPromise) {
    if (server == null) {
      stopPromise.complete();
      return;
    }
    server.close().onComplete(ar -> stopPromise.complete());
  }

  private Router createRouter() {
    Buffer buffer4k = createBuffer(N4K);
    Buffer buffer8k = createBuffer(N8K);
    Buffer buffer64k = createBuffer(N64K);

    Router router = Router.router(vertx);
    router.route().failureHandler(fh -> fh.response().setStatusCode(500).end());

    router.route("/static/4k").handler(rh -> rh.response().end(buffer4k));
    router.route("/static/8k").handler(rh -> rh.response().end(buffer8k));
    router.route("/static/64k").handler(rh -> rh.response().end(buffer64k));

    router.route("/cached/4k").handler(rh -> rh.response().end(fromCache(N4K)));
    router.route("/cached/8k").handler(rh -> rh.response().end(fromCache(N8K)));
    router.route("/cached/64k").handler(rh -> rh.response().end(fromCache(N64K)));

    router.route("/0k").handler(rh -> rh.response().end());

    router.route("/sendFile/test").handler(rh -> rh.response().sendFile(cfg.sendFile));

    router.route("/upload").method(HttpMethod.POST).handler(BodyHandler.create(cfg.uploadDir));
    router.route("/upload").method(HttpMethod.POST).handler(rh -> {
      if (rh.fileUploads().isEmpty()) {
        rh.fail(new IllegalStateException("No upload found.."));
      } else {
        rh.response().end();
      }
    });
    return router;
  }

  private static Buffer fromCache(int len) {
    int key = ThreadLocalRandom.current().nextInt(MAX_RANGE);
    switch (len) {
      case N4K:
        return CACHE_4K.get(key);
      case N8K:
        return CACHE_8K.get(key);
      default:
        return CACHE_64K.get(key);
    }
  }

  private static Buffer createBuffer(int len) {
    return Buffer.buffer(RandomStringUtils.randomAlphanumeric(len));
  }
}
