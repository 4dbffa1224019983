#[automatically_derived]
impl ::trl_runtime::nn::module::Parallelize for Attention {
    const FSDP_UNIT: bool = true;
    fn parallelize(
        &mut self,
        name: &str,
        tp: &::trl_runtime::nn::module::TpContext,
    ) -> ::trl_runtime::Result<()> {
        {
            fn layer<T: ::trl_runtime::nn::module::ColumnParallel>(
                layer: &mut T,
            ) -> &mut T {
                layer
            }
            ::trl_runtime::nn::module::TpLayer::shard(
                layer(&mut self.q_proj),
                &::trl_runtime::nn::module::child_name(name, "q_proj"),
                ::trl_runtime::nn::module::TpStyle::Column {
                    gather_output: false,
                },
                tp,
            )?;
        }
        {
            fn layer<T: ::trl_runtime::nn::module::RowParallel>(
                layer: &mut T,
            ) -> &mut T {
                layer
            }
            ::trl_runtime::nn::module::TpLayer::shard(
                layer(&mut self.o_proj),
                &::trl_runtime::nn::module::child_name(name, "out"),
                ::trl_runtime::nn::module::TpStyle::Row,
                tp,
            )?;
        }
        ::trl_runtime::nn::module::DividedByTp::divide(
            &mut self.num_heads,
            &::trl_runtime::nn::module::child_name(name, "num_heads"),
            tp,
        )?;
        ::trl_runtime::nn::module::Parallelize::parallelize(
            &mut self.norm,
            &::trl_runtime::nn::module::child_name(name, "norm"),
            tp,
        )?;
        Ok(())
    }
    fn visit_params(&self, name: &str, f: &mut ::trl_runtime::nn::module::ParamFn) {
        ::trl_runtime::nn::module::TpLayer::visit_split(
            &self.q_proj,
            &::trl_runtime::nn::module::child_name(name, "q_proj"),
            ::trl_runtime::nn::module::TpStyle::Column {
                gather_output: false,
            },
            f,
        );
        ::trl_runtime::nn::module::TpLayer::visit_split(
            &self.o_proj,
            &::trl_runtime::nn::module::child_name(name, "out"),
            ::trl_runtime::nn::module::TpStyle::Row,
            f,
        );
        ::trl_runtime::nn::module::Parallelize::visit_params(
            &self.norm,
            &::trl_runtime::nn::module::child_name(name, "norm"),
            &mut |n, t, s: ::trl_runtime::nn::module::Split| f(n, t, s.in_split_region()),
        );
    }
    fn visit_weights_mut(
        &mut self,
        name: &str,
        f: &mut ::trl_runtime::nn::module::WeightFn,
    ) -> ::trl_runtime::Result<()> {
        ::trl_runtime::nn::module::Parallelize::visit_weights_mut(
            &mut self.q_proj,
            &::trl_runtime::nn::module::child_name(name, "q_proj"),
            f,
        )?;
        ::trl_runtime::nn::module::Parallelize::visit_weights_mut(
            &mut self.o_proj,
            &::trl_runtime::nn::module::child_name(name, "out"),
            f,
        )?;
        ::trl_runtime::nn::module::Parallelize::visit_weights_mut(
            &mut self.norm,
            &::trl_runtime::nn::module::child_name(name, "norm"),
            f,
        )?;
        Ok(())
    }
    fn visit_linears_mut(
        &mut self,
        name: &str,
        f: &mut ::trl_runtime::nn::module::LinearFn,
    ) -> ::trl_runtime::Result<()> {
        ::trl_runtime::nn::module::Parallelize::visit_linears_mut(
            &mut self.q_proj,
            &::trl_runtime::nn::module::child_name(name, "q_proj"),
            f,
        )?;
        ::trl_runtime::nn::module::Parallelize::visit_linears_mut(
            &mut self.o_proj,
            &::trl_runtime::nn::module::child_name(name, "out"),
            f,
        )?;
        ::trl_runtime::nn::module::Parallelize::visit_linears_mut(
            &mut self.norm,
            &::trl_runtime::nn::module::child_name(name, "norm"),
            f,
        )?;
        Ok(())
    }
    fn visit_units(&self, name: &str, f: &mut dyn FnMut(&str)) {
        ::trl_runtime::nn::module::Parallelize::visit_units(
            &self.norm,
            &::trl_runtime::nn::module::child_name(name, "norm"),
            f,
        );
    }
    fn shard_experts(
        &mut self,
        name: &str,
        ep: ::trl_runtime::nn::module::EpShard,
        f: &mut ::trl_runtime::nn::module::ExpertFn,
    ) -> ::trl_runtime::Result<()> {
        ::trl_runtime::nn::module::Parallelize::shard_experts(
            &mut self.norm,
            &::trl_runtime::nn::module::child_name(name, "norm"),
            ep,
            f,
        )?;
        Ok(())
    }
}
