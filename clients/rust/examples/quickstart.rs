//! Puts and reads state through a running `statord`:
//! `cargo run --release -p statord` in one terminal, then
//! `cargo run --example quickstart -p stator-client` in another.
//! `STATOR_SOCKET` overrides the socket path (default
//! `./stator-run/stator.sock`, the daemon's default).

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use stator_client::keygroup::{java_string_hash, key_group_for_hash};
use stator_client::{AsyncSession, Kind, OpenOptions, Session, ValueState};

/// The smallest executor: park the thread until the future's waker runs.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let socket =
        std::env::var("STATOR_SOCKET").unwrap_or_else(|_| "./stator-run/stator.sock".into());
    let opts = OpenOptions::new("quickstart-job", "word-count");
    let session = Session::open(&socket, &opts)?;
    println!(
        "session {} owns key groups {:?}",
        session.id(),
        session.key_groups()
    );
    let s = AsyncSession::new(session)?;
    let counts = ValueState(s.register("counts", Kind::Value)?);

    block_on(async {
        for word in ["stream", "state", "stream"] {
            let kg = key_group_for_hash(java_string_hash(word), opts.max_parallelism);
            let old = s.read(&counts.get(kg, word.as_bytes())).await?;
            let n = old.map_or(0, |v| u64::from_le_bytes(v.try_into().unwrap_or_default())) + 1;
            s.write(&counts.put(kg, word.as_bytes(), &n.to_le_bytes()))
                .await?;
            println!("{word}: {n} (key group {kg})");
        }
        Ok::<_, stator_client::Error>(())
    })?;
    Ok(())
}
