package dev.railyard.peer.vertx;

/** Bad command line; reported with the usage text and exit code 2. */
public final class UsageException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  public UsageException(String message) {
    super(message);
  }
}
