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
 * and a completion thread of this executor takes completions and completes their futures (the
 * task thread completes those that are ready when it submits); Flink runs the futures'
 * callbacks on the task's mailbox thread. While requests are in flight and
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
        this.sleeper = ch.session().sleeper();
        synchronized (ch) {
            ch.completions(requests);
        }
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
        synchronized (ch) {
            long most = maxInFlight;
            for (StateRequest<?, ?, ?, ?> r : batch.requests) {
                submitChecked(r);
                most = Math.max(most, ch.inFlight());
            }
            maxInFlight = most;
            publish();
            wakeIfDisarmed();
        }
        return CompletableFuture.completedFuture(null);
    }

    /**
     * Runs one request to its end on the calling (task) thread: until its future completed or
     * failed (a failed Flink future never counts as done, so the executor tracks the end itself).
     */
    @Override
    public void executeRequestSync(StateRequest<?, ?, ?, ?> r) {
        synchronized (ch) {
            requests.watch(r);
            try {
                submitChecked(r);
                publish();
                while (!requests.watchedEnded()) {
                    if (Thread.currentThread().isInterrupted()) {
                        throw new InterruptedException("interrupted waiting for a state request");
                    }
                    if (ch.inFlight() == 0) {
                        throw new IllegalStateException("a synchronous state request is neither in statord nor done");
                    }
                    ch.pump();
                    resubmit();
                }
            } catch (Throwable t) {
                fail(t);
            } finally {
                requests.watch(null);
            }
            wakeIfDisarmed();
        }
    }

    private void submitChecked(StateRequest<?, ?, ?, ?> r) {
        Throwable f = failure;
        if (f != null) {
            requests.fail(r, f);
        } else if (!running) {
            requests.fail(r, new IllegalStateException("Stator's state executor is shut down"));
        } else {
            requests.submit(r);
        }
    }

    /** Hands statord what was written, takes what is ready, asks again what must be. */
    private void publish() {
        try {
            ch.flush();
            resubmit();
        } catch (Throwable t) {
            fail(t);
        }
        if (idle && ch.inFlight() > 0) {
            ch.notifyAll();
        }
    }

    /**
     * Asks again what came back too large (or must resume), and hands it to statord at once:
     * left in the command buffer, it would wait for the next call. Under the lock.
     */
    private void resubmit() throws java.io.IOException {
        while (requests.resubmit()) {
            ch.flush();
        }
    }

    /**
     * After the task thread's call: wakes the completion thread if a wait of the call (a full
     * queue) ended the doorbell request it sleeps on. Under the lock (the sleeper is freed under
     * it too).
     */
    private void wakeIfDisarmed() {
        if (sleeping && ch.waits() != armedAt) {
            wakeCompletions();
        }
    }

    /** Under the lock. */
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
                    resubmit();
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

    /** Stops the completion thread; later requests fail, and so do reads still in flight. */
    @Override
    public void shutdown() {
        running = false;
        synchronized (ch) {
            ch.notifyAll();
            wakeCompletions();
        }
        boolean interrupted = false;
        while (completions.isAlive()) {
            try {
                completions.join();
            } catch (InterruptedException e) {
                interrupted = true;
            }
        }
        synchronized (ch) {
            requests.failAll(new IllegalStateException("Stator's state executor is shut down"));
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
