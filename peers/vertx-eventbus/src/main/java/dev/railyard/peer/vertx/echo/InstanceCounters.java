package dev.railyard.peer.vertx.echo;

/**
 * The hot, per-instance mutable state of one tester: written a million+ times a second, and only
 * ever on that instance's event-loop thread.
 *
 * <p>It lives in its own object, allocated on the instance's own thread and padded on both sides
 * (fields of a superclass are laid out before a subclass's), so that two instances' counters can
 * never share a cache line. Without this the counters of instance 0 and instance 1, whose verticle
 * objects are allocated back to back by the deploying thread, ping-pong one cache line between the
 * two cores: contention the benchmark would add on top of Vert.x's own design.
 */
final class InstanceCounters extends InstanceCountersHot {

  @SuppressWarnings("unused")
  private long q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15;
}

/** 128 bytes of padding laid out before the hot fields. */
abstract class InstanceCountersPadBefore {
  @SuppressWarnings("unused")
  private long p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15;
}

/** The hot fields themselves. */
abstract class InstanceCountersHot extends InstanceCountersPadBefore {
  /** Completed round trips (all time, including warm-up). */
  long roundTrips;
  /** Failed or mismatched replies (all time). */
  long failures;
  /** Set when this instance's measurement window closes; chains stop re-sending. */
  boolean stopped;
}
