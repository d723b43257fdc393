package dev.railyard.peer.vertx.pingpong;

import io.vertx.core.AbstractVerticle;
import io.vertx.core.AsyncResult;
import io.vertx.core.eventbus.DeliveryOptions;
import io.vertx.core.eventbus.EventBus;
import io.vertx.core.eventbus.Message;

import java.util.concurrent.CompletableFuture;

/**
 * Seed 000's ProducerVerticle (deployed as a worker): from inside {@code start()} sends N requests
 * to {@link ConsumerVerticle#ADDRESS}, each with a reply handler that counts the replies.
 *
 * <p>All reply handlers run on this verticle's worker context, so, exactly as in the original,
 * they can only start running once the send loop in {@code start()} has returned.
 */
final class ProducerVerticle extends AbstractVerticle {

  /** Large enough never to fire in a healthy run; a fired timeout is counted as a failure. */
  static final long REQUEST_TIMEOUT_MS = 60_000;

  private final int messages;
  private final CompletableFuture<PingPongBench.Outcome> outcome;

  // Only touched on this verticle's (worker) context.
  private long t0;
  private long replyCount;
  private long failures;
  private long firstReplyNanos = -1;

  ProducerVerticle(int messages, CompletableFuture<PingPongBench.Outcome> outcome) {
    this.messages = messages;
    this.outcome = outcome;
  }

  @Override
  public void start() {
    System.out.println("Starting " + getClass().getSimpleName());
    EventBus eb = vertx.eventBus();
    DeliveryOptions options = new DeliveryOptions().setSendTimeout(REQUEST_TIMEOUT_MS);
    System.out.println("Starting to send messages.");
    t0 = System.nanoTime();
    for (int i = 0; i < messages; i++) {
      if (i > 0 && i % 20_000 == 0) {
        System.out.println(i + " eventbus messages sent in " + PingPongBench.msSince(t0) + " ms.");
      }
      final Integer index = i;
      eb.<Object>request(ConsumerVerticle.ADDRESS, index, options)
        .onComplete(ar -> onReply(index, ar));
    }
    System.out.println(messages + " eventbus messages sent in " + PingPongBench.msSince(t0) + " ms.");
  }

  private void onReply(Integer index, AsyncResult<Message<Object>> reply) {
    if (firstReplyNanos < 0) {
      firstReplyNanos = System.nanoTime();
    }
    if (reply.succeeded() && index.equals(reply.result().body())) {
      replyCount++;
      if (replyCount % 10_000 == 0) {
        System.out.println("replyCount: " + replyCount + " after " + PingPongBench.msSince(t0) + " ms");
      }
    } else {
      failures++;
      if (failures <= 10) {
        System.err.println("reply " + index + " failed: "
          + (reply.succeeded() ? "unexpected body " + reply.result().body() : reply.cause()));
      }
    }
    if (replyCount + failures == messages) {
      long allNanos = System.nanoTime();
      System.out.println("all replies received in " + (allNanos - t0) / 1_000_000 + " ms"
        + (failures > 0 ? " (" + failures + " failed)" : ""));
      outcome.complete(new PingPongBench.Outcome(
        (firstReplyNanos - t0) / 1_000_000, (allNanos - t0) / 1_000_000, failures));
    }
  }
}
