//! Element types the CPU backends move and reduce, and dtype dispatch.

use super::ReduceOp;
use candle_core::WithDType;

pub(crate) trait Elem: WithDType + bytemuck::Pod {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn divide(self, n: usize) -> Self;

    /// `dst[i] = op(dst[i], src[i])`; `src` is raw bytes that may be unaligned.
    fn reduce_bytes(op: ReduceOp, dst: &mut [Self], src: &[u8]) {
        match bytemuck::try_cast_slice::<u8, Self>(src) {
            Ok(src) => reduce_slice(op, dst, src),
            Err(_) => {
                let size = std::mem::size_of::<Self>();
                for (d, chunk) in dst.iter_mut().zip(src.chunks_exact(size)) {
                    *d = Self::combine(op, *d, bytemuck::pod_read_unaligned(chunk));
                }
            }
        }
    }
}

fn reduce_slice<T: Elem>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    // Separate loops per op so the compiler vectorises each.
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = T::combine(ReduceOp::Sum, *d, *s);
            }
        }
        _ => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = T::combine(op, *d, *s);
            }
        }
    }
}

/// Types NCCL reduces natively, with how each adds (integers wrap, as NCCL's do).
macro_rules! native_elem {
    ($($t:ty => $add:path),+ $(,)?) => {$(
        impl Elem for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => $add(a, b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
            fn divide(self, n: usize) -> Self {
                self / n as $t
            }
        }
    )+};
}
native_elem! {
    f32 => std::ops::Add::add,
    f64 => std::ops::Add::add,
    u8 => u8::wrapping_add,
    u32 => u32::wrapping_add,
    i64 => i64::wrapping_add,
}

macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                // Reduce in f32, round once: what NCCL does for 16-bit types.
                let (x, y) = (a.to_f32(), b.to_f32());
                <$t>::from_f32(match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Max => x.max(y),
                    ReduceOp::Min => x.min(y),
                })
            }
            fn divide(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
        }
    };
}
half_elem!(half::bf16);
half_elem!(half::f16);

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $T:ident => $body:expr, $unsupported:expr) => {
        dispatch!(@arms $dtype, $T, $body, $unsupported;
            F32 f32, F64 f64, BF16 half::bf16, F16 half::f16, U8 u8, U32 u32, I64 i64)
    };
    (@arms $dtype:expr, $T:ident, $body:expr, $unsupported:expr; $($D:ident $ty:ty),*) => {
        match $dtype {
            $(candle_core::DType::$D => {
                type $T = $ty;
                $body
            })*
            other => $unsupported(other),
        }
    };
}
pub(crate) use dispatch;
