//! statord's configuration file (README, "Configuration"): any text is
//! parsed, checked and turned into the settings the daemon starts shards,
//! stores and the remote tier with, and reloaded over a running
//! configuration, without a panic. A clear error is the only other outcome.
#![no_main]

use libfuzzer_sys::fuzz_target;
use statord::config::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = Config::from_toml(text) else {
        return;
    };
    let Ok(cfg) = cfg.resolve() else { return };
    let _ = (cfg.socket_path(), cfg.status_path(), cfg.tier_config());
    for shard in 0..cfg.shards.min(4) {
        let _ = cfg.store_config(shard);
        let _ = cfg.remote_config(shard);
    }
    let base = Config::from_toml("")
        .expect("defaults")
        .resolve()
        .expect("defaults resolve");
    let _ = base.reload(&cfg);
});
