package dev.railyard.peer.c10k;

import io.micrometer.prometheus.PrometheusConfig;
import io.micrometer.prometheus.PrometheusMeterRegistry;
import io.vertx.core.DeploymentOptions;
import io.vertx.core.Vertx;
import io.vertx.core.VertxOptions;
import io.vertx.micrometer.Label;
import io.vertx.micrometer.Match;
import io.vertx.micrometer.MetricsDomain;
import io.vertx.micrometer.MicrometerMetricsOptions;
import io.vertx.micrometer.VertxPrometheusOptions;

import java.util.EnumSet;
import java.util.concurrent.CountDownLatch;

/**
 * Seed 004's Vert.x C10K server, run by {@code railyard bench c10k --vs vertx}.
 *
 * <pre>
 * java -jar target/vertx-c10k-peer.jar [--host 127.0.0.1] [--port 8080] [--metrics-port 8081]
 *      [--instances N] [--send-file PATH] [--upload-dir DIR]
 * </pre>
 *
 * As in the seed: native transport required, one {@link ServerVerticle} instance per core
 * (override with --instances), Micrometer Prometheus metrics labelled by code, method,
 * local address and path, served by {@link MetricsVerticle}. Prints {@code READY ...} on
 * stdout when both servers listen; stops cleanly on SIGTERM.
 */
public final class Main {

  static final String REGISTRY_NAME = "c10k";

  private Main() {
  }

  public static void main(String[] argv) throws Exception {
    Config cfg;
    try {
      cfg = Config.parse(argv);
    } catch (IllegalArgumentException e) {
      System.err.println("error: " + e.getMessage());
      System.err.println(Config.USAGE);
      System.exit(2);
      return;
    }

    MicrometerMetricsOptions metrics = new MicrometerMetricsOptions()
      .setMicrometerRegistry(new PrometheusMeterRegistry(PrometheusConfig.DEFAULT))
      .setRegistryName(REGISTRY_NAME)
      .setJvmMetricsEnabled(true)
      .setLabels(EnumSet.of(Label.HTTP_CODE, Label.HTTP_METHOD, Label.LOCAL, Label.HTTP_PATH))
      .setPrometheusOptions(new VertxPrometheusOptions().setEnabled(true))
      .setEnabled(true);
    metrics.addLabelMatch(new Match().setDomain(MetricsDomain.HTTP_SERVER).setLabel("local")
      .setAlias("restapi").setValue(cfg.host + ":" + cfg.port));
    metrics.addLabelMatch(new Match().setDomain(MetricsDomain.HTTP_SERVER).setLabel("local")
      .setAlias("monitoring").setValue(cfg.host + ":" + cfg.metricsPort));

    VertxOptions options = new VertxOptions()
      .setPreferNativeTransport(true)
      .setMetricsOptions(metrics);
    Vertx vertx = Vertx.vertx(options);
    if (!vertx.isNativeTransportEnabled()) {
      System.err.println("Native transports have not been enabled: " + vertx.unavailableNativeTransportCause());
      System.exit(10);
    }
    System.out.println("Native transports have been enabled.");

    int instances = cfg.instances > 0 ? cfg.instances : Runtime.getRuntime().availableProcessors();
    System.out.println("Deploying {" + instances + "} verticles");
    vertx.deployVerticle(() -> new ServerVerticle(cfg), new DeploymentOptions().setInstances(instances))
      .compose(id -> vertx.deployVerticle(new MetricsVerticle(cfg)))
      .onSuccess(id -> {
        System.out.println("READY http=" + cfg.host + ":" + cfg.port + " metrics=" + cfg.host + ":"
          + cfg.metricsPort + " instances=" + instances);
        System.out.flush();
      })
      .onFailure(e -> {
        System.err.println("error: deployment failed: " + e);
        e.printStackTrace(System.err);
        System.exit(1);
      });

    CountDownLatch closed = new CountDownLatch(1);
    Runtime.getRuntime().addShutdownHook(new Thread(() -> {
      vertx.close().onComplete(ar -> closed.countDown());
      try {
        closed.await();
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
    }));
  }

  /** Command-line options. */
  static final class Config {
    static final String USAGE = "usage: [--host H] [--port P] [--metrics-port P] [--instances N] "
      + "[--send-file PATH] [--upload-dir DIR]";

    String host = "127.0.0.1";
    int port = 8080;
    int metricsPort = 8081;
    int instances = 0;
    String sendFile = "test";
    String uploadDir = System.getProperty("java.io.tmpdir") + "/vertx-c10k-uploads";

    static Config parse(String[] argv) {
      Config c = new Config();
      for (int i = 0; i < argv.length; i++) {
        String k = argv[i];
        if (i + 1 >= argv.length) {
          throw new IllegalArgumentException("missing value for " + k);
        }
        String v = argv[++i];
        try {
          switch (k) {
            case "--host": c.host = v; break;
            case "--port": c.port = Integer.parseInt(v); break;
            case "--metrics-port": c.metricsPort = Integer.parseInt(v); break;
            case "--instances": c.instances = Integer.parseInt(v); break;
            case "--send-file": c.sendFile = v; break;
            case "--upload-dir": c.uploadDir = v; break;
            default: throw new IllegalArgumentException("unknown option " + k);
          }
        } catch (NumberFormatException e) {
          throw new IllegalArgumentException(k + " needs a number, got " + v);
        }
      }
      return c;
    }
  }
}
