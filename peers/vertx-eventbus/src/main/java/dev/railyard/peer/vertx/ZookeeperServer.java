package dev.railyard.peer.vertx;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Comparator;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;

/**
 * A private, standalone ZooKeeper server for one run: Debian's {@code zookeeper} package
 * ({@code /usr/share/java/zookeeper.jar}, whose manifest class path brings its dependencies, or
 * {@code $ZOOKEEPER_CLASSPATH}), on a free 127.0.0.1 port with a temporary data directory and the
 * admin HTTP server off. Started by the driver for {@code --cluster zookeeper} unless
 * {@code --zk-hosts} is given; stopped and deleted when the run ends.
 */
public final class ZookeeperServer implements AutoCloseable {

  static final String DEFAULT_CLASSPATH = "/usr/share/java/zookeeper.jar";

  private final Process process;
  private final Path dir;
  private final int port;

  private ZookeeperServer(Process process, Path dir, int port) {
    this.process = process;
    this.dir = dir;
    this.port = port;
  }

  public String connectString() {
    return ClusterMode.LOOPBACK + ":" + port;
  }

  public static ZookeeperServer start() throws Exception {
    String classpath = System.getenv().getOrDefault("ZOOKEEPER_CLASSPATH", DEFAULT_CLASSPATH);
    if (!Files.exists(Path.of(classpath.split(":")[0]))) {
      throw new IllegalStateException("ZooKeeper server jar not found at " + classpath
        + ": install Debian's zookeeper package (apt-get install -y zookeeper), set ZOOKEEPER_CLASSPATH,"
        + " or pass --zk-hosts HOST:PORT of a running server");
    }
    Path dir = Files.createTempDirectory("railyard-zk-");
    int port = FreePort.pick(List.of());
    Path cfg = dir.resolve("zoo.cfg");
    Files.writeString(cfg, String.join("\n",
      "tickTime=2000",
      "dataDir=" + dir.resolve("data"),
      "clientPort=" + port,
      "clientPortAddress=" + ClusterMode.LOOPBACK,
      "maxClientCnxns=0",
      "admin.enableServer=false",
      "4lw.commands.whitelist=ruok",
      ""));
    String java = ProcessHandle.current().info().command().orElse(
      Path.of(System.getProperty("java.home"), "bin", "java").toString());
    ProcessBuilder pb = new ProcessBuilder(java, "-Xms256m", "-Xmx512m", "-Dzookeeper.admin.enableServer=false",
      "-cp", classpath, "org.apache.zookeeper.server.ZooKeeperServerMain", cfg.toString())
      .redirectErrorStream(true)
      .redirectOutput(dir.resolve("zookeeper.log").toFile());
    Process process = pb.start();
    ZookeeperServer server = new ZookeeperServer(process, dir, port);
    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(60);
    while (!server.ruok()) {
      if (!process.isAlive()) {
        String log = Files.readString(dir.resolve("zookeeper.log"));
        server.close();
        throw new IllegalStateException("ZooKeeper exited with " + process.exitValue() + ":\n" + log);
      }
      if (System.nanoTime() > deadline) {
        server.close();
        throw new IllegalStateException("ZooKeeper did not answer on " + server.connectString() + " within 60 s");
      }
      Thread.sleep(100);
    }
    System.out.println("started a private ZooKeeper on " + server.connectString());
    return server;
  }

  /** The four-letter health check. */
  private boolean ruok() {
    try (Socket s = new Socket()) {
      s.connect(new InetSocketAddress(ClusterMode.LOOPBACK, port), 500);
      s.setSoTimeout(1000);
      OutputStream out = s.getOutputStream();
      out.write("ruok".getBytes(StandardCharsets.US_ASCII));
      out.flush();
      InputStream in = s.getInputStream();
      byte[] buf = in.readNBytes(4);
      return "imok".equals(new String(buf, StandardCharsets.US_ASCII));
    } catch (IOException e) {
      return false;
    }
  }

  @Override
  public void close() throws Exception {
    process.destroy();
    if (!process.waitFor(10, TimeUnit.SECONDS)) {
      process.destroyForcibly().waitFor(10, TimeUnit.SECONDS);
    }
    try (Stream<Path> walk = Files.walk(dir)) {
      walk.sorted(Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
    }
  }
}
