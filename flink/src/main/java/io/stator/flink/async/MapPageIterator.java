package io.stator.flink.async;

import org.apache.flink.api.common.state.v2.State;
import org.apache.flink.runtime.asyncprocessing.AbstractStateIterator;
import org.apache.flink.runtime.asyncprocessing.StateRequestHandler;
import org.apache.flink.runtime.asyncprocessing.StateRequestType;

import java.util.Collection;

/**
 * One page of a map iteration ({@code MapIter}): its items, and if more follow, the cursor the
 * next page ({@code ITERATOR_LOADING}) resumes from.
 */
final class MapPageIterator<T> extends AbstractStateIterator<T> {

    private final MapCursor next;

    MapPageIterator(
            State state,
            StateRequestType type,
            StateRequestHandler handler,
            Collection<T> page,
            MapCursor next) {
        super(state, type, handler, page);
        this.next = next;
    }

    @Override
    public boolean hasNextLoading() {
        return next != null;
    }

    @Override
    protected Object nextPayloadForContinuousLoading() {
        return next;
    }
}
