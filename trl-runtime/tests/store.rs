//! The rendezvous store under concurrent clients, with timeouts, a wrong token, and a
//! rendezvous that names the ranks that never came.

use std::sync::Arc;
use std::time::{Duration, Instant};
use trl_runtime::dist::{Store, StoreServer};
use trl_runtime::Error;

const T: Duration = Duration::from_secs(10);

fn server() -> (StoreServer, String) {
    let s = StoreServer::bind("127.0.0.1:0", "tok").unwrap();
    let addr = s.addr().to_string();
    (s, addr)
}

#[test]
fn set_get_add_check_delete() {
    let (_s, addr) = server();
    let store = Store::connect(&addr, "tok", T).unwrap();
    store.set("a", b"hello").unwrap();
    assert_eq!(store.get("a").unwrap(), b"hello");
    assert_eq!(store.add("n", 2).unwrap(), 2);
    assert_eq!(store.add("n", -5).unwrap(), -3);
    assert!(store.check(&["a".into(), "n".into()]).unwrap());
    assert!(!store.check(&["a".into(), "zzz".into()]).unwrap());
    assert!(store.delete("a").unwrap());
    assert!(!store.delete("a").unwrap());
    assert!(!store.check(&["a".into()]).unwrap());
}

#[test]
fn get_waits_for_a_later_set_and_times_out_otherwise() {
    let (_s, addr) = server();
    let reader = Store::connect(&addr, "tok", T).unwrap();
    let writer = Store::connect(&addr, "tok", T).unwrap();
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        writer.set("late", b"v").unwrap();
    });
    assert_eq!(reader.get("late").unwrap(), b"v");
    h.join().unwrap();

    let start = Instant::now();
    let e = reader
        .get_timeout("never", Duration::from_millis(200))
        .unwrap_err()
        .to_string();
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert!(e.contains("`never`") && e.contains("did not appear"), "{e}");
    assert!(!reader
        .wait(&["never".into()], Duration::from_millis(50))
        .unwrap());
}

#[test]
fn many_concurrent_clients_count_exactly() {
    let (_s, addr) = server();
    let clients = 16;
    let per_client = 50;
    std::thread::scope(|s| {
        for c in 0..clients {
            let addr = &addr;
            s.spawn(move || {
                let store = Store::connect(addr, "tok", T).unwrap();
                for _ in 0..per_client {
                    store.add("counter", 1).unwrap();
                }
                store.set(&format!("done/{c}"), b"1").unwrap();
                // Everyone waits for everyone: the store serves blocked and active clients at once.
                let keys: Vec<String> = (0..clients).map(|i| format!("done/{i}")).collect();
                assert!(store.wait(&keys, T).unwrap());
            });
        }
    });
    let store = Store::connect(&addr, "tok", T).unwrap();
    assert_eq!(
        store.add("counter", 0).unwrap(),
        (clients * per_client) as i64
    );
}

#[test]
fn wrong_token_is_rejected() {
    let (_s, addr) = server();
    let e = match Store::connect(&addr, "other-job", T) {
        Ok(_) => panic!("a client with the wrong token got in"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("rejected") && e.contains("token"), "{e}");
}

#[test]
fn unreachable_store_fails_after_the_timeout() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let e = match Store::connect(
        &format!("127.0.0.1:{port}"),
        "tok",
        Duration::from_millis(300),
    ) {
        Ok(_) => panic!("connected to nothing"),
        Err(e) => e.to_string(),
    };
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(e.contains("not reachable") && e.contains("rank 0"), "{e}");
}

#[test]
fn port_in_use_is_a_clear_error() {
    let (s, _) = server();
    let e = match StoreServer::bind(&s.addr().to_string(), "tok") {
        Ok(_) => panic!("bound twice"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("already in use") && e.contains("--main_process_port"),
        "{e}"
    );
}

#[test]
fn rendezvous_names_missing_ranks() {
    let (_s, addr) = server();
    let world = 4;
    let present = [0usize, 2];
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = present
            .iter()
            .map(|&rank| {
                let addr = &addr;
                s.spawn(move || {
                    let store = Store::connect(addr, "tok", T).unwrap();
                    store.rendezvous("init", rank, world, Duration::from_millis(300))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        match r {
            Err(Error::RendezvousTimeout {
                missing, world: w, ..
            }) => {
                assert_eq!(missing, vec![1, 3]);
                assert_eq!(w, 4);
            }
            other => panic!("expected a rendezvous timeout, got {other:?}"),
        }
    }
}

#[test]
fn rendezvous_completes_when_all_arrive() {
    let (_s, addr) = server();
    let stores: Vec<_> = (0..3)
        .map(|_| Arc::new(Store::connect(&addr, "tok", T).unwrap()))
        .collect();
    std::thread::scope(|s| {
        for (rank, store) in stores.iter().enumerate() {
            s.spawn(move || store.rendezvous("ok", rank, 3, T).unwrap());
        }
    });
}

#[test]
fn rank_zero_serves_and_others_connect() {
    // Port 0 cannot be shared, so pick a free one first.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    std::thread::scope(|s| {
        for rank in (0..3).rev() {
            let addr = &addr;
            // Higher ranks start first and must wait for rank 0's server.
            s.spawn(move || {
                let store = Store::for_rank(rank, addr, "tok", T).unwrap();
                store.rendezvous("start", rank, 3, T).unwrap();
                store.rendezvous("end", rank, 3, T).unwrap();
            });
        }
    });
}
