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
