package dev.railyard.peer.lettuce;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import io.lettuce.core.RedisURI;
import io.lettuce.core.cluster.ClusterClientOptions;
import io.lettuce.core.cluster.ClusterTopologyRefreshOptions;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.StatefulRedisClusterConnection;
import io.lettuce.core.cluster.api.sync.RedisAdvancedClusterCommands;

import java.io.IOException;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.Executors;

/**
 * Seed 002's service: {@code GET /test} does a SET and a GET of one key through Lettuce's
 * Redis Cluster client and returns the value ("ok", 2 bytes, as in the seed's report).
 *
 * <p>As in the seed's Spring Boot app, the HTTP layer runs blocking handlers on a pool of
 * 200 threads (Tomcat's default maxThreads) over one shared cluster connection using the
 * synchronous API. With {@code --refresh-ms N > 0}, topology refresh is
 * {@code enablePeriodicRefresh(N ms)}; with 0 it is off (Lettuce's defaults otherwise).
 *
 * <p>Usage: {@code --seeds host:port,... --port 8080 [--key test] [--refresh-ms 1000]}.
 * Prints {@code READY <port> <lettuce version>} on stdout once it serves.
 */
public final class Main {
    private Main() {}

    public static void main(String[] args) throws Exception {
        String seeds = null;
        int port = 8080;
        String key = "test";
        long refreshMs = 0;
        for (int i = 0; i + 1 < args.length; i += 2) {
            switch (args[i]) {
                case "--seeds" -> seeds = args[i + 1];
                case "--port" -> port = Integer.parseInt(args[i + 1]);
                case "--key" -> key = args[i + 1];
                case "--refresh-ms" -> refreshMs = Long.parseLong(args[i + 1]);
                default -> usage("unknown option " + args[i]);
            }
        }
        if (seeds == null) {
            usage("--seeds is required");
        }
        List<RedisURI> uris = new ArrayList<>();
        for (String s : seeds.split(",")) {
            String[] hp = s.trim().split(":");
            uris.add(RedisURI.create(hp[0], Integer.parseInt(hp[1])));
        }
        RedisClusterClient client = RedisClusterClient.create(uris);
        ClusterTopologyRefreshOptions.Builder topo = ClusterTopologyRefreshOptions.builder();
        if (refreshMs > 0) {
            topo.enablePeriodicRefresh(Duration.ofMillis(refreshMs));
        }
        client.setOptions(ClusterClientOptions.builder().topologyRefreshOptions(topo.build()).build());
        StatefulRedisClusterConnection<String, String> conn = client.connect();
        RedisAdvancedClusterCommands<String, String> redis = conn.sync();
        final String k = key;

        HttpServer server = HttpServer.create(new InetSocketAddress("127.0.0.1", port), 1024);
        server.setExecutor(Executors.newFixedThreadPool(200));
        server.createContext("/test", ex -> {
            try {
                redis.set(k, "ok");
                String v = redis.get(k);
                respond(ex, 200, v == null ? "" : v);
            } catch (RuntimeException e) {
                respond(ex, 500, "redis error");
            }
        });
        server.start();
        String version = RedisClusterClient.class.getPackage().getImplementationVersion();
        System.out.println("READY " + port + " lettuce " + version);
        System.out.flush();
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            server.stop(0);
            conn.close();
            client.shutdown();
        }));
    }

    private static void respond(HttpExchange ex, int status, String body) throws IOException {
        byte[] b = body.getBytes(StandardCharsets.UTF_8);
        ex.sendResponseHeaders(status, b.length);
        try (OutputStream os = ex.getResponseBody()) {
            os.write(b);
        }
    }

    private static void usage(String why) {
        System.err.println("lettuce-cluster-peer: " + why);
        System.err.println("usage: --seeds host:port,... --port 8080 [--key test] [--refresh-ms 1000]");
        System.exit(2);
    }
}
