package dev.railyard.peer.vertx;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.util.Collection;

/** Picks a currently free TCP port on 127.0.0.1 (the OS chooses; bounded retries). */
public final class FreePort {
  private FreePort() {
  }

  public static int pick(Collection<Integer> avoid) {
    for (int attempt = 0; attempt < 50; attempt++) {
      try (ServerSocket s = new ServerSocket(0, 1, InetAddress.getByName("127.0.0.1"))) {
        int p = s.getLocalPort();
        if (!avoid.contains(p)) {
          return p;
        }
      } catch (IOException e) {
        throw new UncheckedIOException("cannot bind a loopback port", e);
      }
    }
    throw new IllegalStateException("no free loopback port found in 50 attempts");
  }
}
