package dev.railyard.peer.c10k;

import io.vertx.core.AbstractVerticle;
import io.vertx.core.Promise;
import io.vertx.core.http.HttpMethod;
import io.vertx.core.http.HttpServer;
import io.vertx.core.http.HttpServerOptions;
import io.vertx.ext.web.Router;
import io.vertx.micrometer.PrometheusScrapingHandler;

/** The seed's metrics verticle: GET /metrics from the Micrometer Prometheus registry. */
public final class MetricsVerticle extends AbstractVerticle {

  private final Main.Config cfg;
  private HttpServer server;

  MetricsVerticle(Main.Config cfg) {
    this.cfg = cfg;
  }

  @Override
  public void start(Promise<Void> startPromise) {
    HttpServerOptions options = new HttpServerOptions()
      .setPort(cfg.metricsPort)
      .setHost(cfg.host)
      .setCompressionSupported(true)
      .setHandle100ContinueAutomatically(true)
      .setTcpFastOpen(true)
      .setTcpNoDelay(true)
      .setTcpQuickAck(true);
    Router router = Router.router(vertx);
    router.route("/metrics").method(HttpMethod.GET)
      .handler(PrometheusScrapingHandler.create(Main.REGISTRY_NAME));
    server = vertx.createHttpServer(options).requestHandler(router);
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
}
