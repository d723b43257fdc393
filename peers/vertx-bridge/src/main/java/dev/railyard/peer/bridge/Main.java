package dev.railyard.peer.bridge;

import java.util.HashMap;
import java.util.Map;

/**
 * Entry point of the Railyard Vert.x TCP-bridge peer.
 *
 * <pre>
 * server [--port 7000] [--instances N]
 *     Vert.x 4.5.14's TcpEventBusBridge with the bench's echo service and the interop services;
 *     prints "LISTENING port" once every instance listens, then serves until killed.
 * load [--host 127.0.0.1] [--port 7000] [--clients 100] [--duration 10] [--warmup 2]
 *     request/reply round trips through a bridge, one request in flight per client;
 *     the last stdout line is RESULT {json}.
 * </pre>
 */
public final class Main {

  static final String USAGE = String.join("\n",
    "usage:",
    "  server [--port 7000] [--instances N]",
    "  load [--host 127.0.0.1] [--port 7000] [--clients 100] [--duration SECS] [--warmup SECS]");

  private Main() {
  }

  public static void main(String[] argv) {
    int code;
    try {
      if (argv.length == 0) {
        throw new IllegalArgumentException("missing mode (server or load)");
      }
      Map<String, String> opts = parse(argv);
      switch (argv[0]) {
        case "server":
          BridgeServer.run(opts);
          return; // serves until the process is killed
        case "load":
          code = LoadClient.run(opts);
          break;
        default:
          throw new IllegalArgumentException("unknown mode '" + argv[0] + "'");
      }
    } catch (IllegalArgumentException e) {
      System.err.println("error: " + e.getMessage());
      System.err.println(USAGE);
      code = 2;
    } catch (Throwable t) {
      System.err.println("error: " + t);
      t.printStackTrace(System.err);
      code = 1;
    }
    System.out.flush();
    System.exit(code);
  }

  private static Map<String, String> parse(String[] argv) {
    Map<String, String> m = new HashMap<>();
    for (int i = 1; i < argv.length; i += 2) {
      if (!argv[i].startsWith("--") || i + 1 >= argv.length) {
        throw new IllegalArgumentException("expected --name value, got '" + argv[i] + "'");
      }
      m.put(argv[i].substring(2), argv[i + 1]);
    }
    return m;
  }

  static int intOpt(Map<String, String> m, String name, int def) {
    String v = m.get(name);
    return v == null ? def : Integer.parseInt(v);
  }

  static double doubleOpt(Map<String, String> m, String name, double def) {
    String v = m.get(name);
    return v == null ? def : Double.parseDouble(v);
  }
}
