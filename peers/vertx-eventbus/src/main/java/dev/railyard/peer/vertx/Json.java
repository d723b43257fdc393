package dev.railyard.peer.vertx;

import io.vertx.core.json.JsonObject;

/** Prints the machine-readable last line. */
public final class Json {
  private Json() {
  }

  public static void printResult(JsonObject result) {
    System.out.flush();
    System.err.flush();
    System.out.println("RESULT " + result.encode());
    System.out.flush();
  }
}
