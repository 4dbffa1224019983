//! Point-to-point byte transport under the CPU backends. Each message carries the collective
//! that sent it and its length, so ranks that disagree (different order, different shapes)
//! get an error naming both sides instead of garbage or a hang.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum OpCode {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    SendRecv = 5,
    AllToAll = 6,
    Barrier = 7,
}

impl OpCode {
    pub fn name(self) -> &'static str {
        match self {
            OpCode::AllReduce => "all_reduce",
            OpCode::AllGather => "all_gather",
            OpCode::ReduceScatter => "reduce_scatter",
            OpCode::Broadcast => "broadcast",
            OpCode::SendRecv => "send/recv",
            OpCode::AllToAll => "all_to_all",
            OpCode::Barrier => "barrier",
        }
    }

    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => OpCode::AllReduce,
            2 => OpCode::AllGather,
            3 => OpCode::ReduceScatter,
            4 => OpCode::Broadcast,
            5 => OpCode::SendRecv,
            6 => OpCode::AllToAll,
            7 => OpCode::Barrier,
            _ => return None,
        })
    }
}

/// Describes a message that was not the one expected.
pub(crate) fn mismatch(
    peer: usize,
    want: OpCode,
    want_len: usize,
    got: u32,
    got_len: usize,
) -> String {
    let got_name = OpCode::from_u32(got)
        .map(|o| o.name())
        .unwrap_or("an unknown operation");
    format!(
        "expected {} bytes of {} from rank {peer} but it sent {} bytes of {}: ranks issued collectives in a different order or with different shapes",
        want_len,
        want.name(),
        got_len,
        got_name
    )
}

/// Where a receive hands its bytes: `sink(offset, bytes)`.
pub(crate) type Sink<'a> = dyn FnMut(usize, &[u8]) + 'a;
/// A transport's outcome: an error is a message naming what failed.
pub(crate) type Sent = std::result::Result<(), String>;

pub(crate) trait Transport: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn backend(&self) -> &'static str;
    /// Whether `send` can block until the peer reads (then large sends run beside receives).
    fn send_may_block(&self) -> bool;
    fn send(&self, peer: usize, op: OpCode, data: &[u8]) -> Sent;
    /// Receives exactly `len` bytes from `peer`, handing them to `sink(offset, bytes)` in order,
    /// in pieces whose lengths are multiples of 8 bytes (except the last).
    fn recv(&self, peer: usize, op: OpCode, len: usize, sink: &mut Sink<'_>) -> Sent;
}
