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
    /// Decode steps whose changing inputs live on the device ([`Self::fix_steps`]).
    steps: Option<StepBuffers>,
}

/// What changes from one decode step of one token to the next, in device buffers that the
/// step's kernels read, so that a CUDA graph captured once replays every step
/// (`generation::graph`): the step's length and positions, and each window's key spans.
/// The host writes them before each step ([`KvCache::write_step`]).
#[derive(Debug)]
struct StepBuffers {
    /// u32 [1 + batch]: the tokens held, then each row's position of its new token.
    held: Tensor,
    /// Per window (None: causal): u32 [2 x batch], each row's first key, then its end.
    spans: Vec<(Option<Window>, Option<f64>, Tensor)>,
    /// While a graph is captured: a buffer first needed now could not be filled.
    capturing: bool,
}

/// Copies `values` into the device (or CPU) buffer `t` of as many u32.
fn write(t: &Tensor, values: Vec<u32>) -> Result<()> {
    let n = values.len();
    t.slice_set(&Tensor::from_vec(values, n, t.device())?, 0, 0)
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
            steps: None,
        }
    }

    /// From now on each forward is one token whose length, positions and key spans the
    /// kernels read from device buffers on `device`, written by [`Self::write_step`] before
    /// the forward: what a captured CUDA graph needs, as every forward's kernels then take
    /// the same arguments. Layers that keep something else than keys and values refuse it.
    pub fn fix_steps(&mut self, device: &candle_core::Device) -> Result<()> {
        let held = Tensor::zeros(1 + self.starts.len(), candle_core::DType::U32, device)?;
        self.steps = Some(StepBuffers {
            held,
            spans: Vec::new(),
            capturing: false,
        });
        self.write_step()
    }

    /// Back to forwards that take their length from the host.
    pub fn unfix_steps(&mut self) {
        self.steps = None;
    }

    /// Whether the steps are fixed ([`Self::fix_steps`]).
    pub fn steps_fixed(&self) -> bool {
        self.steps.is_some()
    }

    /// Marks a CUDA graph's capture: a window's spans first needed during it are refused
    /// (their buffer could not be filled before each launch).
    pub fn set_capturing(&mut self, capturing: bool) {
        if let Some(s) = &mut self.steps {
            s.capturing = capturing;
        }
    }

    /// Writes the next one-token step's length, positions and spans into the fixed buffers.
    pub fn write_step(&mut self) -> Result<()> {
        let Some(steps) = &self.steps else {
            return Ok(());
        };
        let mut held = vec![self.len as u32];
        held.extend(self.step_positions().iter().map(|&p| p as u32));
        write(&steps.held, held)?;
        for (window, softcap, buffer) in &steps.spans {
            write(buffer, self.spans(1, *window, *softcap).both())?;
        }
        Ok(())
    }

    /// Each row's position of the next one-token step (transformers': the tokens after its
    /// left padding).
    fn step_positions(&self) -> Vec<i64> {
        self.starts
            .iter()
            .map(|&s| self.len.saturating_sub(s) as i64)
            .collect()
    }

    /// The next one-token step's positions when the steps are fixed: on the host, and on
    /// the device (u32 [batch], a view of the fixed buffer) for the rotary tables' rows.
    pub fn fixed_positions(&self) -> Option<(Vec<i64>, Tensor)> {
        let steps = self.steps.as_ref()?;
        let b = self.starts.len();
        Some((self.step_positions(), steps.held.narrow(0, 1, b).ok()?))
    }

    /// After a replayed step (a CUDA graph's launch, no attention call on the host): its
    /// `tokens` are held.
    pub fn advance(&mut self, tokens: usize) {
        self.next = 0;
        self.len += tokens;
    }

    /// Forgets the attention calls of a forward that did not happen (a captured one: its
    /// kernels ran nothing yet; or one that failed part-way, to be run again).
    pub fn abandon(&mut self) {
        self.next = 0;
    }

    fn refuse_fixed(&self, what: &str) -> Result<()> {
        if self.steps.is_some() {
            candle_core::bail!("KV cache: {what} is not replayed as fixed steps (a CUDA graph)");
        }
        Ok(())
    }

    /// Tokens it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
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
        // A recurrent state is replaced each step: a replayed graph would keep reading the
        // first one. `keep_state` refuses it under fixed steps.
        let slot = self.next;
        self.next += 1;
        (slot, self.slots.get(slot).cloned())
    }

    /// Keeps `state` in `slot` (from [`Self::state`]) for the next forward.
    pub fn keep_state(&mut self, slot: usize, state: (Tensor, Tensor)) -> Result<()> {
        self.refuse_fixed("a recurrent layer's state")?;
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
        if let Some(held) = self.steps.as_ref().map(|s| s.held.narrow(0, 0, 1)) {
            if sq != 1 {
                candle_core::bail!("KV cache: fixed steps are of one token, not {sq}");
            }
            let (held, spans) = (held?, self.fixed_spans(window, softcap)?);
            let (kc, vc) = &self.slots[slot];
            decode::append_at(kc, k, &held)?;
            decode::append_at(vc, v, &held)?;
            return self.attend_fixed(q, (kc, vc), &spans, (softcap, sinks));
        }
        let (kc, vc) = &self.slots[slot];
        kc.slice_set(&k.contiguous()?, 2, self.len)?;
        vc.slice_set(&v.contiguous()?, 2, self.len)?;
        let held = (kc, vc, self.len + sq);
        self.attend_over(q, (k, v), held, (window, softcap, sinks))
    }

    /// The fixed buffer of `window`'s spans, made and filled the first time it is asked for.
    fn fixed_spans(&mut self, window: Option<Window>, softcap: Option<f64>) -> Result<Tensor> {
        let fresh = self.spans(1, window, softcap).both();
        let Some(steps) = &mut self.steps else {
            candle_core::bail!("KV cache: the steps are not fixed");
        };
        if let Some((.., t)) = steps
            .spans
            .iter()
            .find(|(w, c, _)| *w == window && *c == softcap)
        {
            return Ok(t.clone());
        }
        if steps.capturing {
            candle_core::bail!("KV cache: a window first attended while a CUDA graph is captured");
        }
        let t = Tensor::zeros(fresh.len(), candle_core::DType::U32, steps.held.device())?;
        write(&t, fresh)?;
        steps.spans.push((window, softcap, t.clone()));
        Ok(t)
    }

    /// One-token queries over the fixed buffers: the GPU kernel reads the spans on the
    /// device; elsewhere (a CPU run of fixed steps) the host's spans are those written.
    fn attend_fixed(
        &self,
        q: &Tensor,
        (kc, vc): (&Tensor, &Tensor),
        spans: &Tensor,
        (softcap, sinks): (Option<f64>, Option<&Tensor>),
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if crate::kernels::cuda_decode::applies(q, kc) {
            let cap = softcap.map(|c| c as f32);
            let (out, lse) =
                crate::kernels::cuda_decode::attention_on_device(q, (kc, vc), spans, cap)?;
            let out = match sinks {
                Some(s) => crate::kernels::sinks::fold(&out, &lse, s)?.0,
                None => out,
            };
            return out.to_dtype(q.dtype());
        }
        // The spans as the buffer holds them, so that a CPU run checks what was written.
        let both = spans.to_vec1::<u32>()?;
        let n = both.len() / 2;
        let spans = KeySpans::new(1, both[..n].to_vec(), both[n..].to_vec()).with_softcap(softcap);
        let new = |t: &Tensor| t.narrow(2, self.len, 1);
        let held = (kc, vc, self.len + 1);
        self.attend_spans(q, (&new(kc)?, &new(vc)?), held, &spans, sinks)
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
        self.refuse_fixed("a layer reusing another's keys")?;
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
        self.refuse_fixed("latent attention's cache")?;
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
        let spans = self.spans(q.dim(2)?, window, softcap);
        self.attend_spans(q, (k, v), (kc, vc, keys), &spans, sinks)
    }

    /// [`Self::attend_over`] with the queries' `spans` given.
    fn attend_spans(
        &self,
        q: &Tensor,
        (k, v): (&Tensor, &Tensor),
        (kc, vc, keys): (&Tensor, &Tensor, usize),
        spans: &KeySpans,
        sinks: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (out, lse) = match () {
            // A prompt: the new keys are all there is, through the prefill kernel's GEMMs.
            _ if self.len == 0 && cpu_flash::applies(q, k) => {
                cpu_flash::forward(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, spans)?
            }
            _ if decode::applies(q, kc) => decode::attention(q, (kc, vc), keys, spans)?,
            #[cfg(feature = "cuda")]
            _ if crate::kernels::cuda_decode::applies(q, kc) => {
                crate::kernels::cuda_decode::attention(q, (kc, vc), keys, spans)?
            }
            _ => decode::attention_reference(q, (kc, vc), keys, spans)?,
        };
        let out = match sinks {
            Some(s) => crate::kernels::sinks::fold(&out, &lse, s)?.0,
            None => out,
        };
        out.to_dtype(q.dtype())
    }
}
