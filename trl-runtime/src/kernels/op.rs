//! How a Candle op is declared here, once for all of them: `fused_op!` for custom ops (name,
//! CPU kernel, CUDA kernel, backward), `inplace_op!` for in-place ops. Its own file so that
//! every kernel file (and `optim`, `nn`) can use it without using each other.

/// Declares a fused op in one place: its name, its CPU kernel, its CUDA kernel (compiled with the
/// `cuda` feature) and, where it has one, its backward. `[this]` names `self` in the clauses;
/// `cpu` and `cuda` name each input's storage and layout, `bwd` the inputs, then after `;` the
/// output and its gradient. Written out, every op repeated the same Candle signatures.
macro_rules! fused_op {
    (@grads CustomOp1) => { Option<Tensor> };
    (@grads CustomOp2) => { (Option<Tensor>, Option<Tensor>) };
    (@grads CustomOp3) => { (Option<Tensor>, Option<Tensor>, Option<Tensor>) };
    ($op:ty: $trait:ident [$this:ident] {
        name: $name:expr,
        cpu($($s:pat_param, $l:pat_param),+) $cpu:block
        cuda($($c:pat_param, $cl:pat_param),+) $cuda:block
        $(bwd($($a:tt),+; $res:tt, $grad:tt) $bwd:block)?
    }) => {
        impl candle_core::$trait for $op {
            fn name(&self) -> &'static str {
                #[allow(unused_variables)]
                let $this = self;
                $name
            }

            fn cpu_fwd(&self, $($s: &CpuStorage, $l: &Layout),+) -> Result<(CpuStorage, Shape)> {
                #[allow(unused_variables)]
                let $this = self;
                $cpu
            }

            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                $($c: &candle_core::CudaStorage, $cl: &Layout),+
            ) -> Result<(candle_core::CudaStorage, Shape)> {
                #[allow(unused_variables)]
                let $this = self;
                $cuda
            }

            $(
            fn bwd(
                &self,
                $($a: &Tensor,)+
                $res: &Tensor,
                $grad: &Tensor,
            ) -> Result<fused_op!(@grads $trait)> {
                #[allow(unused_variables)]
                let $this = self;
                $bwd
            }
            )?
        }
    };
}
pub(crate) use fused_op;

/// [`fused_op!`] for Candle's in-place ops (`InplaceOp1/2/3`): the first storage is the one
/// written. Without a `cuda` clause the op runs on the CPU only (Candle's default refuses it
/// on a GPU).
macro_rules! inplace_op {
    // One device's forward: `$f` over storages of type `$S`, the first one written.
    (@fwd $f:ident, $S:ty, $this:ident, ($s0:pat_param, $l0:pat_param $(, $s:pat_param, $l:pat_param)*) $body:block) => {
        fn $f(
            &self,
            $s0: &mut $S,
            $l0: &candle_core::Layout,
            $($s: &$S, $l: &candle_core::Layout),*
        ) -> candle_core::Result<()> {
            #[allow(unused_variables)]
            let $this = self;
            $body
        }
    };
    ($op:ty: $trait:ident [$this:ident] {
        name: $name:expr,
        cpu $cpu_args:tt $cpu:block
        $(cuda $cuda_args:tt $cuda:block)?
    }) => {
        impl candle_core::$trait for $op {
            fn name(&self) -> &'static str {
                $name
            }

            inplace_op!(@fwd cpu_fwd, candle_core::CpuStorage, $this, $cpu_args $cpu);

            $(
            #[cfg(feature = "cuda")]
            inplace_op!(@fwd cuda_fwd, candle_core::CudaStorage, $this, $cuda_args $cuda);
            )?
        }
    };
}
pub(crate) use inplace_op;
