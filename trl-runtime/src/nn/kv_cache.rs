//! The keys and values of the tokens generated so far, per attention layer, so that each new
//! token is one query against them instead of a forward over the whole sequence
//! (transformers' `DynamicCache`).
//!
//! Rows are left-padded as `generate` pads them: row `b`'s keys start at `starts[b]` in the
//! cache; the pads before are never seen. A layer's buffers are allocated once, for the
//! whole generation (`capacity` tokens), and each forward writes its new keys after the ones
//! held. A model's attention reaches the cache through `LayerInputs::attention_with` (every
//! built-in layer and every model that attends through `LayerInputs`): the n-th attention
//! call of a forward is the n-th slot, so the model itself does not change. A layer with a
//! recurrent state instead (Gated DeltaNet) keeps it in its slot ([`KvCache::state`]).

use crate::kernels::cpu_flash::KeySpans;
use crate::kernels::{cpu_flash, decode};
use crate::nn::Window;
use candle_core::{Result, Tensor};

/// Every layer's cached keys and values, and where each row's own tokens begin.
#[derive(Debug)]
pub struct KvCache {
    /// Per attention call of a forward: keys and values [batch, kv_heads, capacity, head_dim]
    /// (or a recurrent layer's state, [`Self::state`]).
    slots: Vec<(Tensor, Tensor)>,
    /// Tokens held (the same for every row: pads included).
    len: usize,
    capacity: usize,
    /// Row b's first real key.
    starts: Vec<usize>,
    /// The slot the next attention call of this forward uses.
    next: usize,
}

impl KvCache {
    /// An empty cache for rows whose tokens start at `starts` (their left padding), holding
    /// at most `capacity` tokens.
    pub fn new(starts: Vec<usize>, capacity: usize) -> Self {
        KvCache {
            slots: Vec::new(),
            len: 0,
            capacity,
            starts,
            next: 0,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the buffers allocated so far.
    pub fn bytes(&self) -> usize {
        self.slots
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }

    /// Where each row's own tokens begin (its left padding before them).
    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// A recurrent layer's state in this forward's slot (Gated DeltaNet's: its
    /// convolution's last inputs and the delta rule's state): what the forward before left,
    /// None on the prompt. The layer leaves its new state with [`Self::keep_state`] under
    /// the returned slot before the next layer reaches the cache.
    pub fn state(&mut self) -> (usize, Option<(Tensor, Tensor)>) {
        let slot = self.next;
        self.next += 1;
        (slot, self.slots.get(slot).cloned())
    }

    /// Keeps `state` in `slot` (from [`Self::state`]) for the next forward.
    pub fn keep_state(&mut self, slot: usize, state: (Tensor, Tensor)) -> Result<()> {
        match slot.cmp(&self.slots.len()) {
            std::cmp::Ordering::Less => self.slots[slot] = state,
            std::cmp::Ordering::Equal => self.slots.push(state),
            std::cmp::Ordering::Greater => candle_core::bail!(
                "KV cache: a state for slot {slot}, {} slots held",
                self.slots.len()
            ),
        }
        Ok(())
    }

    /// Ends a forward of `tokens` new tokens: they are held from now on. Returns how many
    /// attention calls the forward made through the cache (0: the model attends without it).
    pub fn commit(&mut self, tokens: usize) -> Result<usize> {
        let used = std::mem::take(&mut self.next);
        if used != self.slots.len() {
            candle_core::bail!(
                "KV cache: this forward attended {used} times, the first {} times",
                self.slots.len()
            );
        }
        if used > 0 {
            self.len += tokens;
        }
        Ok(used)
    }

    /// Which cached keys each new query sees: from its row's start (and within its `window`,
    /// positions counted from the row's start) to itself. A pad query of a prompt sees
    /// nothing.
    fn spans(&self, sq: usize, window: Option<Window>, softcap: Option<f64>) -> KeySpans {
        let (mut lo, mut hi) = (Vec::new(), Vec::new());
        for &start in &self.starts {
            for i in 0..sq {
                let at = self.len + i;
                let from = match window {
                    Some(w) => w.first(at, start, at.saturating_sub(start)),
                    None => start,
                };
                lo.push(from as u32);
                hi.push(if at < start { from } else { at + 1 } as u32);
            }
        }
        KeySpans::new(sq, lo, hi).with_softcap(softcap)
    }

    /// Attention of the new queries `q` [b, heads, sq, d] over the cached keys and the new
    /// ones `k`, `v` [b, kv_heads, sq, d], which join the cache; `window`, `softcap` and
    /// `sinks` [heads] as the layer's attention has them.
    pub fn attend(
        &mut self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        window: Option<Window>,
        softcap: Option<f64>,
        sinks: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, kv_heads, sq, d) = k.dims4()?;
        self.check_room(b, sq)?;
        let slot = self.next_slot((b, kv_heads, d), (k.dtype(), k.device()), true)?;
        let (kc, vc) = &self.slots[slot];
        kc.slice_set(&k.contiguous()?, 2, self.len)?;
        vc.slice_set(&v.contiguous()?, 2, self.len)?;
        let held = (kc, vc, self.len + sq);
        self.attend_over(q, (k, v), held, (window, softcap, sinks))
    }

    /// Attention of the new queries `q` [b, heads, sq, d] over the keys and values an
    /// earlier layer of this forward put in `slot` (Gemma 4's KV sharing: a layer that
    /// reuses another's keys and values reads that layer's cache, every token of it, and
    /// keeps nothing of its own). It takes a slot of its own, empty, so that the layers
    /// after it keep theirs.
    pub fn attend_reused(
        &mut self,
        q: &Tensor,
        slot: usize,
        window: Option<Window>,
        softcap: Option<f64>,
    ) -> Result<Tensor> {
        let (b, _, sq, _) = q.dims4()?;
        self.check_room(b, sq)?;
        if slot >= self.next {
            candle_core::bail!(
                "KV cache: attention call {} reuses slot {slot}, which no earlier call filled",
                self.next
            );
        }
        let own = self.next;
        self.next += 1;
        if own == self.slots.len() {
            let none = Tensor::zeros((b, 0, 0, 0), q.dtype(), q.device())?;
            self.slots.push((none.clone(), none));
        }
        let (kc, vc) = &self.slots[slot];
        let keys = self.len + sq;
        let (k, v) = (kc.narrow(2, self.len, sq)?, vc.narrow(2, self.len, sq)?);
        self.attend_over(q, (&k, &v), (kc, vc, keys), (window, softcap, None))
    }

    /// Latent attention's cache (DeepSeek's MLA, as transformers keeps it): this attention
    /// call's slot holds what `new` [b, 1, sq, w] compresses of each token (its keys and
    /// values before they are expanded per head), `new` joins it, and all held so far are
    /// returned [b, 1, len + sq, w]. The layer expands them and attends with
    /// [`Self::attend_held`].
    pub fn hold(&mut self, new: &Tensor) -> Result<Tensor> {
        let (b, one, sq, w) = new.dims4()?;
        self.check_room(b, sq)?;
        let slot = self.next_slot((b, one, w), (new.dtype(), new.device()), false)?;
        let held = &self.slots[slot].0;
        held.slice_set(&new.contiguous()?, 2, self.len)?;
        held.narrow(2, 0, self.len + sq)?.contiguous()
    }

    /// Attention of the new queries `q` [b, heads, sq, d] over `k`, `v` [b, kv_heads, len +
    /// sq, d]: every key held and the new ones, expanded from what [`Self::hold`] returned.
    pub fn attend_held(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        window: Option<Window>,
        softcap: Option<f64>,
        sinks: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.attend_over(q, (k, v), (k, v, k.dim(2)?), (window, softcap, sinks))
    }

    fn check_room(&self, b: usize, sq: usize) -> Result<()> {
        if b != self.starts.len() {
            candle_core::bail!(
                "KV cache: {b} rows, the cache was made for {}",
                self.starts.len()
            );
        }
        if self.len + sq > self.capacity {
            candle_core::bail!(
                "KV cache: {} tokens held, {sq} more exceed its capacity of {}",
                self.len,
                self.capacity
            );
        }
        Ok(())
    }

    /// This attention call's slot, its buffers of `capacity` tokens of (b, heads, d)
    /// allocated on first use (the value buffer only when `values`).
    fn next_slot(
        &mut self,
        (b, heads, d): (usize, usize, usize),
        (dtype, device): (candle_core::DType, &candle_core::Device),
        values: bool,
    ) -> Result<usize> {
        let slot = self.next;
        self.next += 1;
        if slot == self.slots.len() {
            let buffer = |t: usize| Tensor::zeros((b, heads, t, d), dtype, device);
            let v = buffer(if values { self.capacity } else { 0 })?;
            self.slots.push((buffer(self.capacity)?, v));
        }
        Ok(slot)
    }

    /// Attention of `q` over the first `keys` of `kc`, `vc`, whose last are this forward's
    /// `k`, `v` (all of them for a prompt, which the prefill kernel takes without the rest of
    /// the buffers).
    fn attend_over(
        &self,
        q: &Tensor,
        (k, v): (&Tensor, &Tensor),
        (kc, vc, keys): (&Tensor, &Tensor, usize),
        (window, softcap, sinks): (Option<Window>, Option<f64>, Option<&Tensor>),
    ) -> Result<Tensor> {
        let sq = q.dim(2)?;
        let spans = self.spans(sq, window, softcap);
        let (out, lse) = match () {
            // A prompt: the new keys are all there is, through the prefill kernel's GEMMs.
            _ if self.len == 0 && cpu_flash::applies(q, k) => {
                cpu_flash::forward(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, &spans)?
            }
            _ if decode::applies(q, kc) => decode::attention(q, (kc, vc), keys, &spans)?,
            #[cfg(feature = "cuda")]
            _ if crate::kernels::cuda_decode::applies(q, kc) => {
                crate::kernels::cuda_decode::attention(q, (kc, vc), keys, &spans)?
            }
            _ => decode::attention_reference(q, (kc, vc), keys, &spans)?,
        };
        let out = match sinks {
            Some(s) => crate::kernels::sinks::fold(&out, &lse, s)?.0,
            None => out,
        };
        out.to_dtype(q.dtype())
    }
}
