package dev.railyard.peer.vertx.pingpong;

import io.vertx.core.AbstractVerticle;
import io.vertx.core.Promise;
import io.vertx.core.eventbus.Message;

/**
 * Seed 000's ConsumerVerticle (deployed as a worker): listens on {@link #ADDRESS} and replies to
 * every request with the request's own body.
 */
final class ConsumerVerticle extends AbstractVerticle {

  static final String ADDRESS = "ping-address";

  private long startNanos;
  private boolean firstMessageReceived;

  @Override
  public void start(Promise<Void> startPromise) {
    System.out.println("Starting " + getClass().getSimpleName());
    startNanos = System.nanoTime();
    vertx.eventBus()
      .<Object>consumer(ADDRESS, this::onMessage)
      .completionHandler(ar -> {
        if (ar.succeeded()) {
          System.out.println("Consumer registered after " + PingPongBench.msSince(startNanos) + " ms");
          // The deployment (and so the producer's deployment) completes only now.
          startPromise.complete();
        } else {
          startPromise.fail(ar.cause());
        }
      });
  }

  private void onMessage(Message<Object> message) {
    if (!firstMessageReceived) {
      firstMessageReceived = true;
      System.out.println("Received first message after " + PingPongBench.msSince(startNanos) + " ms");
    }
    message.reply(message.body());
  }
}
