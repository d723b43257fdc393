package dev.railyard.peer.vertx;

import dev.railyard.peer.vertx.echo.EchoBench;
import dev.railyard.peer.vertx.pingpong.PingPongBench;

import java.util.Arrays;

/**
 * Entry point of the Railyard Vert.x event-bus peer.
 *
 * <pre>
 * pingpong --messages 500000 [NODE OPTIONS]
 * echo --duration 10 --warmup 2 --instances 2 --in-flight 64 --consumer consumer|local
 *      --delivery default|local-only --method send-reply|send-send [NODE OPTIONS]
 * NODE OPTIONS: --cluster none|hazelcast|infinispan|zookeeper  --nodes 1|2  --zk-hosts HOST:PORT
 * </pre>
 *
 * The last stdout line of a successful run is {@code RESULT {json}}; the process then exits 0.
 * Usage errors exit 2. See {@link NodeOptions} for the options of the second JVM.
 */
public final class Main {

  static final String USAGE = String.join("\n",
    "usage:",
    "  pingpong --messages N [NODE OPTIONS]",
    "  echo --duration SECS --warmup SECS --instances N --in-flight M",
    "       --consumer consumer|local --delivery default|local-only --method send-reply|send-send",
    "       [NODE OPTIONS]",
    "NODE OPTIONS:",
    "  --cluster none|hazelcast|infinispan|zookeeper   Vert.x cluster manager (default none)",
    "  --nodes 1|2        2: the consumers run in a second JVM that this one starts and stops",
    "  --zk-hosts H:P     zookeeper: use this server instead of starting a private one",
    "durations are in seconds and may be fractional");

  private Main() {
  }

  public static void main(String[] argv) {
    int code;
    try {
      code = run(argv);
    } catch (UsageException e) {
      System.err.println("error: " + e.getMessage());
      System.err.println(USAGE);
      code = 2;
    } catch (Throwable t) {
      System.err.println("error: benchmark failed: " + t);
      t.printStackTrace(System.err);
      code = 1;
    }
    System.out.flush();
    System.err.flush();
    // Vert.x threads are non-daemon; always leave explicitly (after vertx.close() inside the bench).
    System.exit(code);
  }

  private static int run(String[] argv) throws Exception {
    if (argv.length == 0) {
      throw new UsageException("missing scenario (pingpong or echo)");
    }
    String scenario = argv[0];
    Args args = Args.parse(Arrays.copyOfRange(argv, 1, argv.length));
    switch (scenario) {
      case "pingpong":
        return PingPongBench.run(PingPongBench.Config.from(args));
      case "echo":
        return EchoBench.run(EchoBench.Config.from(args));
      case "-h":
      case "--help":
      case "help":
        System.out.println(USAGE);
        return 0;
      default:
        throw new UsageException("unknown scenario '" + scenario + "' (expected pingpong or echo)");
    }
  }
}
