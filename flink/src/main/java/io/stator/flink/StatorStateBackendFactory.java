package io.stator.flink;

import org.apache.flink.configuration.ReadableConfig;
import org.apache.flink.runtime.state.StateBackendFactory;

/**
 * Selects the Stator backend: {@code state.backend.type: io.stator.flink.StatorStateBackendFactory}
 * (options under {@code state.backend.stator.*}, see {@link StatorOptions}).
 */
public class StatorStateBackendFactory implements StateBackendFactory<StatorStateBackend> {

    @Override
    public StatorStateBackend createFromConfig(ReadableConfig config, ClassLoader classLoader) {
        return new StatorStateBackend().configure(config, classLoader);
    }
}
