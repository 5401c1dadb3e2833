package io.stator.flink.async;

import io.stator.flink.jni.Sleeper;
import io.stator.flink.jni.StatorException;
import io.stator.flink.session.RequestChannel;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.asyncprocessing.AsyncRequestContainer;
import org.apache.flink.runtime.asyncprocessing.StateExecutor;
import org.apache.flink.runtime.asyncprocessing.StateRequest;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;

/**
 * Flink's {@link StateExecutor} over one statord session: a batch of state requests becomes
 * submissions on the session's queue, all in one call, and their futures complete from the
 * completion queue, out of order (statord keeps per-key order), with thousands in flight.
 *
 * <p>Two threads drive the session's channel, one at a time under its lock: the task thread
 * submits ({@link #executeBatchRequests}, and waits only for a synchronous request of its own),
 * and a completion thread of this executor takes completions and completes their futures; Flink
 * runs the futures' callbacks on the task's mailbox thread. While requests are in flight and
 * none is ready, the completion thread sleeps on the session's doorbell (statord rings it at the
 * next completion), not holding the lock; with nothing in flight it waits for a submission. It
 * never spins: a third busy thread beside the task and statord's shard stalls both on a small
 * host.
 */
public final class StatorStateExecutor implements StateExecutor {

    private static final Logger LOG = LoggerFactory.getLogger(StatorStateExecutor.class);

    /** The longest sleep on the doorbell before the completion thread looks again. */
    private static final int SLEEP_MS = 100;

    private final RequestChannel ch;
    private final Requests requests;
    private final Sleeper sleeper;
    private final Thread completions;
    /** In flight from which the executor counts as fully loaded (Flink then stops sending). */
    private final int fullAt;

    private volatile boolean running = true;
    /** Under the channel's lock: the completion thread waits for a submission, or sleeps. */
    private boolean idle;
    private boolean sleeping;
    /** The channel's {@link RequestChannel#waits()} when the completion thread armed the doorbell. */
    private long armedAt;
    private volatile Throwable failure;
    /**
     * The most requests in the session's queues at once (submitted and not yet reaped), as the
     * task thread saw while submitting.
     */
    private volatile long maxInFlight;

    public StatorStateExecutor(RequestChannel ch, TypeSerializer<?> keySerializer, String name)
            throws StatorException {
        this.ch = ch;
        this.requests = new Requests(ch, keySerializer);
        this.fullAt = ch.capacity() - ch.capacity() / 8;
        synchronized (ch) {
            ch.completions(requests);
        }
        this.sleeper = ch.session().sleeper();
        this.completions = new Thread(this::run, "stator-completions " + name);
        completions.setDaemon(true);
        completions.start();
    }

    /** A batch: the requests in the order Flink offered them. */
    private static final class Batch implements AsyncRequestContainer<StateRequest<?, ?, ?, ?>> {
        final List<StateRequest<?, ?, ?, ?>> requests = new ArrayList<>();

        @Override
        public void offer(StateRequest<?, ?, ?, ?> r) {
            requests.add(r);
        }

        @Override
        public boolean isEmpty() {
            return requests.isEmpty();
        }
    }

    @Override
    public AsyncRequestContainer<StateRequest<?, ?, ?, ?>> createRequestContainer() {
        return new Batch();
    }

    /**
     * Submits the batch; the returned future completes once it is in statord's queue (each
     * request's own future completes with its result).
     */
    @Override
    public CompletableFuture<Void> executeBatchRequests(AsyncRequestContainer<StateRequest<?, ?, ?, ?>> container) {
        Batch batch = (Batch) container;
        boolean wake;
        synchronized (ch) {
            long most = maxInFlight;
            for (StateRequest<?, ?, ?, ?> r : batch.requests) {
                submitChecked(r);
                most = Math.max(most, ch.inFlight());
            }
            maxInFlight = most;
            publish();
            wake = afterCall();
        }
        if (wake) {
            wakeCompletions();
        }
        return CompletableFuture.completedFuture(null);
    }

    /** Runs one request to its end on the calling (task) thread. */
    @Override
    public void executeRequestSync(StateRequest<?, ?, ?, ?> r) {
        boolean wake;
        synchronized (ch) {
            submitChecked(r);
            publish();
            try {
                while (!r.getFuture().isDone()) {
                    ch.pump();
                    requests.resubmit();
                }
            } catch (Throwable t) {
                fail(t);
            }
            wake = afterCall();
        }
        if (wake) {
            wakeCompletions();
        }
    }

    private void submitChecked(StateRequest<?, ?, ?, ?> r) {
        Throwable f = failure;
        if (f != null) {
            r.getFuture().completeExceptionally("statord's session failed", f);
        } else {
            requests.submit(r);
        }
    }

    /** Hands statord what was written, takes what is ready, asks again what must be. */
    private void publish() {
        try {
            ch.flush();
            requests.resubmit();
        } catch (Throwable t) {
            fail(t);
        }
        if (idle && ch.inFlight() > 0) {
            ch.notifyAll();
        }
    }

    /**
     * After the task thread's call: whether the completion thread must be woken because a wait
     * of the call (a full queue) ended its doorbell request. Under the lock.
     */
    private boolean afterCall() {
        return sleeping && ch.waits() != armedAt;
    }

    private void wakeCompletions() {
        try {
            sleeper.wake();
        } catch (StatorException e) {
            LOG.warn("Could not wake the completion thread; it looks again within {} ms", SLEEP_MS, e);
        }
    }

    /** Requests in statord now. */
    public long inFlight() {
        return ch.inFlight();
    }

    /** The most requests this executor had in statord at once. */
    public long maxInFlight() {
        return maxInFlight;
    }

    @Override
    public boolean fullyLoaded() {
        return ch.inFlight() >= fullAt;
    }

    // ------------------------------------------------------------------------
    //  The completion thread
    // ------------------------------------------------------------------------

    private void run() {
        try {
            while (running) {
                synchronized (ch) {
                    if (!running) {
                        break;
                    }
                    if (ch.inFlight() == 0) {
                        idle = true;
                        try {
                            ch.wait(SLEEP_MS);
                        } finally {
                            idle = false;
                        }
                        continue;
                    }
                    int n = ch.flush();
                    requests.resubmit();
                    if (n > 0) {
                        continue;
                    }
                    if (ch.session().arm()) {
                        ch.session().disarm();
                        continue;
                    }
                    sleeping = true;
                    armedAt = ch.waits();
                }
                try {
                    sleeper.sleep(SLEEP_MS);
                } finally {
                    synchronized (ch) {
                        sleeping = false;
                        if (running) {
                            ch.session().disarm();
                        }
                    }
                }
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        } catch (Throwable t) {
            synchronized (ch) {
                fail(t);
            }
        }
    }

    /** The session failed: every read in flight fails with it, and every later request. Under the lock. */
    private void fail(Throwable t) {
        if (failure == null) {
            failure = t;
            if (running) {
                LOG.error("statord's session failed; every state request in flight fails", t);
            }
        }
        requests.failAll(failure);
    }

    /** Stops the completion thread; reads still in flight are not completed. */
    @Override
    public void shutdown() {
        running = false;
        synchronized (ch) {
            ch.notifyAll();
        }
        wakeCompletions();
        boolean interrupted = false;
        while (completions.isAlive()) {
            try {
                completions.join();
            } catch (InterruptedException e) {
                interrupted = true;
            }
        }
        synchronized (ch) {
            ch.completions(null);
            sleeper.close();
        }
        if (interrupted) {
            Thread.currentThread().interrupt();
        }
    }

    /** Whether {@link #shutdown()} ran. */
    public boolean isShutdown() {
        return !running;
    }
}
