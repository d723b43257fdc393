package dev.railyard.peer.vertx.echo;

import io.vertx.core.AbstractVerticle;
import io.vertx.core.AsyncResult;
import io.vertx.core.Context;
import io.vertx.core.Future;
import io.vertx.core.Handler;
import io.vertx.core.Promise;
import io.vertx.core.eventbus.DeliveryOptions;
import io.vertx.core.eventbus.EventBus;
import io.vertx.core.eventbus.Message;
import io.vertx.core.eventbus.MessageConsumer;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * Seed 001's tester verticle: an echoer that also drives its share of the request chains.
 *
 * <p>Everything an instance does (its echo consumer, its chains' reply handlers, its window timers)
 * runs on its own event-loop context, so the round-trip counter is a plain {@code long} that is
 * only ever read and written on that one thread.
 */
final class EchoTester extends AbstractVerticle {

  static final String ECHO_ADDRESS = "echo";
  static final String REPLY_TO_HEADER = "replyTo";
  /** The original's message body. */
  static final String BODY = ":)";
  /** {@code -Dpeer.progress=true}: print each instance's rate once a second (diagnostics only). */
  static final boolean PROGRESS = Boolean.getBoolean("peer.progress");

  private final EchoBench.Run run;
  private final EchoBench.Config cfg;
  private final int index;
  private final int chains;

  private EventBus eb;
  private DeliveryOptions options;
  private Context context;
  private final List<Runnable> starters = new ArrayList<>();

  // Confined to this instance's event-loop thread; allocated there in start().
  private InstanceCounters hot;
  private long windowStartCount;
  private long windowStartFailures;
  private long windowStartNanos;

  // Written on this instance's thread before run.windowsClosed.countDown(), read by the driver after await().
  private long windowRoundTrips;
  private long windowFailures;
  private long windowMeasuredNanos;

  EchoTester(EchoBench.Run run, int index) {
    this.run = run;
    this.cfg = run.cfg;
    this.index = index;
    this.chains = cfg.chainsFor(index);
  }

  @Override
  public void start(Promise<Void> startPromise) {
    eb = vertx.eventBus();
    hot = new InstanceCounters();
    options = cfg.deliveryOptions();
    context = vertx.getOrCreateContext();
    List<Future<Void>> registrations = new ArrayList<>();

    Handler<Message<Object>> echo;
    if (cfg.sendSend) {
      echo = msg -> eb.send(msg.headers().get(REPLY_TO_HEADER), msg.body(), options);
    } else {
      echo = msg -> msg.reply(msg.body(), options);
    }
    if (run.part != EchoBench.Part.CHAINS) {
      registrations.add(completion(register(ECHO_ADDRESS, echo)));
    }

    for (int c = 0; run.part != EchoBench.Part.ECHO && c < chains; c++) {
      if (cfg.sendSend) {
        SendSendChain chain = new SendSendChain(replyAddress(index, c));
        registrations.add(completion(register(chain.replyAddress, chain)));
        starters.add(chain::send);
      } else {
        SendReplyChain chain = new SendReplyChain();
        starters.add(chain::send);
      }
    }
    Future.all(registrations).<Void>mapEmpty().onComplete(startPromise);
  }

  /** The send-send reply address of chain {@code c} of instance {@code i}. */
  static String replyAddress(int i, int c) {
    return "echo.reply." + i + "." + c;
  }

  private MessageConsumer<Object> register(String address, Handler<Message<Object>> handler) {
    return cfg.localConsumer ? eb.localConsumer(address, handler) : eb.consumer(address, handler);
  }

  private static Future<Void> completion(MessageConsumer<Object> consumer) {
    Promise<Void> p = Promise.promise();
    consumer.completionHandler(p);
    return p.future();
  }

  /** Called from the driver thread once every instance is deployed and registered. */
  void kick() {
    context.runOnContext(v -> {
      long warmupMs = TimeUnit.NANOSECONDS.toMillis(run.warmupNanos);
      long endMs = TimeUnit.NANOSECONDS.toMillis(run.warmupNanos + run.windowNanos);
      if (warmupMs >= 1) {
        vertx.setTimer(warmupMs, id -> openWindow());
      } else {
        openWindow();
      }
      vertx.setTimer(Math.max(1, endMs), id -> closeWindow());
      if (PROGRESS) {
        long kicked = System.nanoTime();
        long[] last = {0, kicked};
        vertx.setPeriodic(1000, id -> {
          if (hot.stopped) {
            vertx.cancelTimer(id);
            return;
          }
          long now = System.nanoTime();
          System.out.printf("  [instance %d] t=%.1fs %.0f round trips/s%n", index, (now - kicked) / 1e9,
            (hot.roundTrips - last[0]) * 1e9 / (now - last[1]));
          last[0] = hot.roundTrips;
          last[1] = now;
        });
      }
      for (Runnable s : starters) {
        s.run();
      }
    });
  }

  private void openWindow() {
    windowStartNanos = System.nanoTime();
    windowStartCount = hot.roundTrips;
    windowStartFailures = hot.failures;
  }

  private void closeWindow() {
    long now = System.nanoTime();
    windowRoundTrips = hot.roundTrips - windowStartCount;
    windowFailures = hot.failures - windowStartFailures;
    windowMeasuredNanos = now - windowStartNanos;
    hot.stopped = true;
    run.windowsClosed.countDown();
  }

  long windowRoundTrips() {
    return windowRoundTrips;
  }

  long windowFailures() {
    return windowFailures;
  }

  long windowMeasuredNanos() {
    return windowMeasuredNanos;
  }

  /** Send_Reply: request the echo, and on the reply send the next request. */
  private final class SendReplyChain implements Handler<AsyncResult<Message<Object>>> {
    void send() {
      eb.<Object>request(ECHO_ADDRESS, BODY, options).onComplete(this);
    }

    @Override
    public void handle(AsyncResult<Message<Object>> ar) {
      InstanceCounters h = hot;
      if (ar.succeeded() && BODY.equals(ar.result().body())) {
        h.roundTrips++;
      } else {
        h.failures++;
      }
      if (!h.stopped) {
        send();
      }
    }
  }

  /**
   * Send_Send: a consumer of the same kind on a unique reply address; the echoer {@code send}s the
   * body to the address from the {@code replyTo} header instead of replying.
   */
  private final class SendSendChain implements Handler<Message<Object>> {
    final String replyAddress;
    final DeliveryOptions sendOptions;

    SendSendChain(String replyAddress) {
      this.replyAddress = replyAddress;
      // Same delivery options plus the header; built once per chain (headers are copied per message).
      this.sendOptions = new DeliveryOptions(options).addHeader(REPLY_TO_HEADER, replyAddress);
    }

    void send() {
      eb.send(ECHO_ADDRESS, BODY, sendOptions);
    }

    @Override
    public void handle(Message<Object> msg) {
      InstanceCounters h = hot;
      if (BODY.equals(msg.body())) {
        h.roundTrips++;
      } else {
        h.failures++;
      }
      if (!h.stopped) {
        send();
      }
    }
  }
}
