//! Runtime dispatch of the CPU kernels' row loops to an AVX-512 or AVX2 + FMA build.

/// Defines `$name` to run `$body` (an `#[inline(always)]` function) compiled for AVX-512 when
/// the CPU has it, else for AVX2 + FMA when it has those (checked once per call, cached by std),
/// for the baseline target otherwise: the loops are written branch-free so that LLVM
/// vectorizes them either way (and inlines the exp polynomial, whose `floor` is a call on the
/// baseline target). An optional `<T: Bound>` makes the functions generic over the element
/// type.
macro_rules! simd_dispatch {
    ($name:ident, $avx2:ident, $body:ident, $(<$g:ident: $bound:path>,)? ($($arg:ident: $ty:ty),*)) => {
        fn $name$(<$g: $bound>)?($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                unsafe fn avx512$(<$g: $bound>)?($($arg: $ty),*) {
                    $body($($arg),*)
                }
                if std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512dq")
                    && std::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the CPU supports these AVX-512 subsets (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    return unsafe { $avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx2$(<$g: $bound>)?($($arg: $ty),*) {
            $body($($arg),*)
        }
    };
}

pub(crate) use simd_dispatch;

/// AVX-512 helpers shared by the kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Lane `j` of the result is the sum of `v[j]`'s sixteen lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
        // Pairs interleaved by 32 bits: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
        let mut l1 = [_mm512_setzero_ps(); 8];
        for p in 0..8 {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            l1[p] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // Then by 64 bits: per 128-bit lane, vectors 4q..4q + 4's sums of that lane.
        let mut l2 = [_mm512_setzero_ps(); 4];
        for q in 0..4 {
            let (x, y) = (_mm512_castps_pd(l1[2 * q]), _mm512_castps_pd(l1[2 * q + 1]));
            let (lo, hi) = (_mm512_unpacklo_pd(x, y), _mm512_unpackhi_pd(x, y));
            l2[q] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
        }
        // Across 128-bit lanes, twice: [A.0 + A.1, A.2 + A.3, B.0 + B.1, B.2 + B.3].
        let l3 = [halves(l2[0], l2[1]), halves(l2[2], l2[3])];
        halves(l3[0], l3[1])
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn halves(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    }
}
