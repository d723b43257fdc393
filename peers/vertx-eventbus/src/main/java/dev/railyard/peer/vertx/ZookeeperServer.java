package dev.railyard.peer.vertx;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.concurrent.TimeUnit;

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
    // A shell keeps the server tied to this JVM: it runs ZooKeeper in the background and waits
    // for end-of-file on its stdin (this JVM closing it, or dying), then stops ZooKeeper and
    // deletes the data directory. So no ZooKeeper outlives its run, even after a SIGKILL.
    String script = "exec 3<&0; \"$0\" -Xms256m -Xmx512m -Dzookeeper.admin.enableServer=false -cp \"$1\""
      + " org.apache.zookeeper.server.ZooKeeperServerMain \"$2/zoo.cfg\" </dev/null >\"$2/zookeeper.log\" 2>&1 &"
      + " z=$!; cat <&3 >/dev/null; kill $z; wait $z; rm -rf \"$2\"";
    ProcessBuilder pb = new ProcessBuilder("sh", "-c", script, java, classpath, dir.toString())
      .redirectErrorStream(true)
      .redirectOutput(ProcessBuilder.Redirect.DISCARD);
    Process process = pb.start();
    ZookeeperServer server = new ZookeeperServer(process, dir, port);
    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(60);
    while (!server.ruok()) {
      if (!process.isAlive() || (System.nanoTime() > deadline)) {
        Path logFile = dir.resolve("zookeeper.log");
        String log = Files.exists(logFile) ? Files.readString(logFile) : "(no log)";
        server.close();
        throw new IllegalStateException("ZooKeeper did not answer on " + server.connectString()
          + " within 60 s; its log:\n" + log);
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

  /** Closes the shell's stdin: it stops ZooKeeper and deletes the data directory. */
  @Override
  public void close() throws Exception {
    try {
      process.getOutputStream().close();
    } catch (IOException e) {
      // Already gone.
    }
    if (!process.waitFor(30, TimeUnit.SECONDS)) {
      System.err.println("warning: ZooKeeper did not stop within 30 s");
      process.destroyForcibly().waitFor(10, TimeUnit.SECONDS);
    }
  }
}
