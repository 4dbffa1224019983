//! The host backend: ranks are processes (on one or several machines) connected by TCP, one
//! socket per pair of group members. Connections are set up through the rendezvous store and
//! authenticated with the job token. A peer that dies closes its sockets, so the others get an
//! error at once; a peer that hangs is reported after the timeout.

use super::ring::RingComm;
use super::transport::{mismatch, OpCode, Transport};
use super::Communicator;
use crate::dist::store::Store;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"TRLCOMM1";
/// Receive granularity: large enough to amortise syscalls, small enough to reduce while the
/// kernel keeps receiving.
const CHUNK: usize = 1 << 20;
const HEADER: usize = 16;

/// Creates host-backend groups for this process.
pub struct HostBackend {
    store: Arc<Store>,
    token: String,
    /// This process's rank in the world (members of groups are world ranks).
    rank: usize,
    timeout: Duration,
    generations: Mutex<HashMap<String, usize>>,
}

struct Peer {
    reader: Mutex<TcpStream>,
    writer: Mutex<TcpStream>,
}

struct TcpTransport {
    rank: usize,
    size: usize,
    /// Global ranks of the members, for messages.
    members: Vec<usize>,
    peers: Vec<Option<Peer>>,
    timeout: Duration,
}

fn io_message(e: &std::io::Error, peer_global: usize, timeout: Duration, doing: &str) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
            format!("rank {peer_global} closed its connection while we were {doing}: it exited or crashed (see its log)")
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
            "no data from rank {peer_global} for {timeout:?} while {doing}: it may be hung or running a different collective"
        ),
        _ => format!("socket error with rank {peer_global} while {doing}: {e}"),
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        "host"
    }
    fn send_may_block(&self) -> bool {
        true
    }

    fn send(&self, peer: usize, op: OpCode, data: &[u8]) -> std::result::Result<(), String> {
        let p = self.peers[peer].as_ref().ok_or("cannot send to self")?;
        let mut w = p.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut header = [0u8; HEADER];
        header[..4].copy_from_slice(&(op as u32).to_le_bytes());
        header[8..].copy_from_slice(&(data.len() as u64).to_le_bytes());
        let result = if data.len() <= 64 << 10 {
            // One write for small messages (header + payload) keeps latency down.
            let mut msg = Vec::with_capacity(HEADER + data.len());
            msg.extend_from_slice(&header);
            msg.extend_from_slice(data);
            w.write_all(&msg)
        } else {
            w.write_all(&header).and_then(|_| w.write_all(data))
        };
        result.map_err(|e| io_message(&e, self.members[peer], self.timeout, "sending"))
    }

    fn recv(
        &self,
        peer: usize,
        op: OpCode,
        len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> std::result::Result<(), String> {
        let p = self.peers[peer]
            .as_ref()
            .ok_or("cannot receive from self")?;
        let mut r = p.reader.lock().unwrap_or_else(|e| e.into_inner());
        let global = self.members[peer];
        let mut header = [0u8; HEADER];
        r.read_exact(&mut header)
            .map_err(|e| io_message(&e, global, self.timeout, "waiting for its message"))?;
        let got_op = u32::from_le_bytes(header[..4].try_into().unwrap());
        let got_len = u64::from_le_bytes(header[8..].try_into().unwrap()) as usize;
        if got_op != op as u32 || got_len != len {
            return Err(mismatch(global, op, len, got_op, got_len));
        }
        // u64 backing keeps the chunk 8-byte aligned, so elements can be read in place.
        let mut scratch = vec![0u64; CHUNK.min(len).div_ceil(8)];
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch);
        let mut offset = 0;
        while offset < len {
            let n = CHUNK.min(len - offset);
            r.read_exact(&mut scratch[..n])
                .map_err(|e| io_message(&e, global, self.timeout, "receiving its data"))?;
            sink(offset, &scratch[..n]);
            offset += n;
        }
        Ok(())
    }
}

fn configure(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(())
}

impl HostBackend {
    /// `rank` is this process's world rank; `timeout` bounds every wait on a peer.
    pub fn new(
        store: Arc<Store>,
        token: impl Into<String>,
        rank: usize,
        timeout: Duration,
    ) -> Self {
        HostBackend {
            store,
            token: token.into(),
            rank,
            timeout,
            generations: Mutex::new(HashMap::new()),
        }
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Connects this process to the other `members` (world ranks, in group order) of the group
    /// `name`. Every member must call this with the same name and members.
    pub fn group(&self, name: &str, members: &[usize]) -> Result<Arc<dyn Communicator>> {
        let fail = |m: String| Error::Comm {
            op: "new_group",
            group: name.into(),
            rank: self.rank,
            message: m,
        };
        let me = members
            .iter()
            .position(|&m| m == self.rank)
            .ok_or_else(|| fail(format!("rank {} is not a member of {members:?}", self.rank)))?;
        let generation = {
            let mut g = self.generations.lock().unwrap();
            let e = g.entry(name.to_string()).or_insert(0);
            *e += 1;
            *e
        };
        let key = format!("comm/{name}/{members:?}/{generation}");
        let n = members.len();
        let mut peers: Vec<Option<Peer>> = (0..n).map(|_| None).collect();
        if n > 1 {
            let listener = TcpListener::bind((self.store.local_ip(), 0))
                .map_err(|e| fail(format!("cannot listen for peers: {e}")))?;
            let addr = listener.local_addr().map_err(|e| fail(e.to_string()))?;
            self.store
                .set(&format!("{key}/addr/{me}"), addr.to_string().as_bytes())?;
            let deadline = Instant::now() + self.timeout;
            // Lower members accept, higher members connect: each pair gets exactly one socket.
            for (j, peer) in peers.iter_mut().enumerate().take(me) {
                let text = self
                    .store
                    .get_timeout(&format!("{key}/addr/{j}"), self.timeout)?;
                let peer_addr: SocketAddr = String::from_utf8_lossy(&text)
                    .parse()
                    .map_err(|e| fail(format!("bad address from rank {}: {e}", members[j])))?;
                let mut stream = connect_until(peer_addr, deadline).map_err(|e| {
                    fail(format!(
                        "cannot connect to rank {} at {peer_addr}: {e}",
                        members[j]
                    ))
                })?;
                let mut hello = MAGIC.to_vec();
                for field in [self.token.as_bytes(), key.as_bytes()] {
                    hello.extend_from_slice(&(field.len() as u32).to_le_bytes());
                    hello.extend_from_slice(field);
                }
                hello.extend_from_slice(&(me as u32).to_le_bytes());
                stream
                    .write_all(&hello)
                    .map_err(|e| fail(format!("handshake with rank {}: {e}", members[j])))?;
                *peer = Some(make_peer(stream, self.timeout).map_err(|e| fail(e.to_string()))?);
            }
            let mut waiting = n - 1 - me;
            listener
                .set_nonblocking(true)
                .map_err(|e| fail(e.to_string()))?;
            while waiting > 0 {
                match listener.accept() {
                    Ok((stream, from)) => {
                        stream.set_nonblocking(false).ok();
                        match self.read_hello(&stream, &key, n) {
                            Ok(j) if j > me && peers[j].is_none() => {
                                peers[j] = Some(make_peer(stream, self.timeout).map_err(|e| fail(e.to_string()))?);
                                waiting -= 1;
                            }
                            Ok(j) => tracing::warn!("group {name}: duplicate or unexpected connection from member {j} ({from}): dropped"),
                            Err(why) => tracing::warn!("group {name}: rejected a connection from {from}: {why}"),
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let missing: Vec<usize> = (me + 1..n)
                                .filter(|&j| peers[j].is_none())
                                .map(|j| members[j])
                                .collect();
                            return Err(fail(format!(
                                "rank(s) {missing:?} did not connect within {:?}: were they launched, and can they reach {addr}?",
                                self.timeout
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => return Err(fail(format!("accept failed: {e}"))),
                }
            }
        }
        let transport = TcpTransport {
            rank: me,
            size: n,
            members: members.to_vec(),
            peers,
            timeout: self.timeout,
        };
        Ok(Arc::new(RingComm::new(
            transport,
            format!("{name}{members:?}"),
        )))
    }

    /// Validates a peer's hello (job token, group) and returns its member index.
    fn read_hello(
        &self,
        mut stream: &TcpStream,
        key: &str,
        n: usize,
    ) -> std::result::Result<usize, String> {
        stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
        let mut magic = [0u8; 8];
        stream.read_exact(&mut magic).map_err(|e| e.to_string())?;
        if &magic != MAGIC {
            return Err("not a cargo-trl peer".into());
        }
        let mut field = || -> std::result::Result<Vec<u8>, String> {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len).map_err(|e| e.to_string())?;
            let len = u32::from_le_bytes(len) as usize;
            if len > 4096 {
                return Err("oversized handshake".into());
            }
            let mut buf = vec![0u8; len];
            stream.read_exact(&mut buf).map_err(|e| e.to_string())?;
            Ok(buf)
        };
        if field()? != self.token.as_bytes() {
            return Err("wrong job token".into());
        }
        if field()? != key.as_bytes() {
            return Err("it belongs to another group".into());
        }
        let mut idx = [0u8; 4];
        stream.read_exact(&mut idx).map_err(|e| e.to_string())?;
        let idx = u32::from_le_bytes(idx) as usize;
        if idx >= n {
            return Err(format!("member index {idx} out of range"));
        }
        Ok(idx)
    }
}

fn connect_until(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn make_peer(stream: TcpStream, timeout: Duration) -> std::io::Result<Peer> {
    configure(&stream, timeout)?;
    let writer = stream.try_clone()?;
    Ok(Peer {
        reader: Mutex::new(stream),
        writer: Mutex::new(writer),
    })
}
