package dev.railyard.peer.vertx;

import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;

/**
 * The second JVM of a {@code --nodes 2} run: the same java binary, the same JVM flags and class
 * path as this (driver) JVM, running {@code Main <scenario> <scenario options> --role server ...}.
 *
 * <p>Protocol over its standard streams: it prints {@link #READY} on stdout once it has joined the
 * cluster and its consumers' registrations have completed; every other stdout line is copied to
 * this JVM's stderr with a {@code [server]} prefix (stdout stays the driver's, RESULT last). Its
 * stderr is inherited. It stops when it reads {@code stop} or end-of-file on stdin, so it also goes
 * away if the driver dies.
 */
public final class ServerProcess implements AutoCloseable {

  public static final String READY = "RAILYARD-SERVER-READY";

  private final Process process;
  private final CompletableFuture<Void> ready = new CompletableFuture<>();

  private ServerProcess(Process process) {
    this.process = process;
  }

  public static ServerProcess start(String scenario, List<String> argv) throws IOException {
    String java = ProcessHandle.current().info().command().orElse(
      Path.of(System.getProperty("java.home"), "bin", "java").toString());
    List<String> cmd = new ArrayList<>();
    cmd.add(java);
    cmd.addAll(ManagementFactory.getRuntimeMXBean().getInputArguments());
    cmd.add("-cp");
    cmd.add(System.getProperty("java.class.path"));
    cmd.add(Main.class.getName());
    cmd.add(scenario);
    cmd.addAll(argv);
    System.out.println("starting the server JVM: " + scenario + " " + String.join(" ", argv));
    Process p = new ProcessBuilder(cmd).redirectError(ProcessBuilder.Redirect.INHERIT).start();
    ServerProcess server = new ServerProcess(p);
    Thread pump = new Thread(server::pumpStdout, "server-stdout");
    pump.setDaemon(true);
    pump.start();
    return server;
  }

  private void pumpStdout() {
    try (BufferedReader r = new BufferedReader(new InputStreamReader(process.getInputStream(),
      StandardCharsets.UTF_8))) {
      String line;
      while ((line = r.readLine()) != null) {
        if (line.equals(READY)) {
          ready.complete(null);
        } else {
          System.err.println("[server] " + line);
        }
      }
    } catch (IOException e) {
      // The process is gone; reported through ready / close().
    }
    ready.completeExceptionally(new IllegalStateException("the server JVM exited before it was ready"));
  }

  /** Blocks until the server JVM reports ready, or fails if it exits first or takes too long. */
  public void awaitReady(long timeout, TimeUnit unit) throws Exception {
    try {
      ready.get(timeout, unit);
    } catch (java.util.concurrent.TimeoutException e) {
      throw new IllegalStateException("the server JVM was not ready within " + unit.toSeconds(timeout) + " s");
    } catch (java.util.concurrent.ExecutionException e) {
      throw new IllegalStateException(e.getCause().getMessage()
        + (process.isAlive() ? "" : " (exit code " + process.exitValue() + ")"));
    }
  }

  /** Asks the server to leave the cluster and exit; kills it if it does not within 60 s. */
  @Override
  public void close() throws Exception {
    if (process.isAlive()) {
      try (OutputStream in = process.getOutputStream()) {
        in.write("stop\n".getBytes(StandardCharsets.US_ASCII));
      } catch (IOException e) {
        // Already exiting.
      }
    }
    if (!process.waitFor(60, TimeUnit.SECONDS)) {
      System.err.println("warning: the server JVM did not stop within 60 s; killing it");
      process.destroyForcibly().waitFor(10, TimeUnit.SECONDS);
    } else if (process.exitValue() != 0) {
      System.err.println("warning: the server JVM exited with " + process.exitValue());
    }
  }

  /** Server side: announce readiness, then block until the driver says stop (or goes away). */
  public static void serveUntilStopped() throws IOException {
    System.out.println(READY);
    System.out.flush();
    BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
    String line;
    while ((line = in.readLine()) != null) {
      if (line.trim().equals("stop")) {
        break;
      }
    }
    System.out.println("stopping");
  }
}
