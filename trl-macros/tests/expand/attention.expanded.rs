#[automatically_derived]
impl ::trl_runtime::tp::Parallelize for Attention {
    const FSDP_UNIT: bool = true;
    fn parallelize(
        &mut self,
        name: &str,
        tp: &::trl_runtime::tp::TpContext,
    ) -> ::trl_runtime::Result<()> {
        {
            fn layer<T: ::trl_runtime::tp::ColumnParallel>(layer: &mut T) -> &mut T {
                layer
            }
            ::trl_runtime::tp::TpLayer::shard(
                layer(&mut self.q_proj),
                &::trl_runtime::tp::child_name(name, "q_proj"),
                ::trl_runtime::tp::TpStyle::Column {
                    gather_output: false,
                },
                tp,
            )?;
        }
        {
            fn layer<T: ::trl_runtime::tp::RowParallel>(layer: &mut T) -> &mut T {
                layer
            }
            ::trl_runtime::tp::TpLayer::shard(
                layer(&mut self.o_proj),
                &::trl_runtime::tp::child_name(name, "out"),
                ::trl_runtime::tp::TpStyle::Row,
                tp,
            )?;
        }
        ::trl_runtime::tp::DividedByTp::divide(
            &mut self.num_heads,
            &::trl_runtime::tp::child_name(name, "num_heads"),
            tp,
        )?;
        ::trl_runtime::tp::Parallelize::parallelize(
            &mut self.norm,
            &::trl_runtime::tp::child_name(name, "norm"),
            tp,
        )?;
        Ok(())
    }
    fn visit_params(
        &self,
        name: &str,
        f: &mut dyn FnMut(
            &str,
            &::trl_runtime::candle_core::Tensor,
            ::trl_runtime::tp::Split,
        ),
    ) {
        ::trl_runtime::tp::TpLayer::visit_split(
            &self.q_proj,
            &::trl_runtime::tp::child_name(name, "q_proj"),
            ::trl_runtime::tp::TpStyle::Column {
                gather_output: false,
            },
            f,
        );
        ::trl_runtime::tp::TpLayer::visit_split(
            &self.o_proj,
            &::trl_runtime::tp::child_name(name, "out"),
            ::trl_runtime::tp::TpStyle::Row,
            f,
        );
        ::trl_runtime::tp::Parallelize::visit_params(
            &self.norm,
            &::trl_runtime::tp::child_name(name, "norm"),
            f,
        );
    }
    fn visit_weights_mut(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(
            &str,
            &mut ::trl_runtime::nn::Weight,
        ) -> ::trl_runtime::Result<()>,
    ) -> ::trl_runtime::Result<()> {
        ::trl_runtime::tp::Parallelize::visit_weights_mut(
            &mut self.q_proj,
            &::trl_runtime::tp::child_name(name, "q_proj"),
            f,
        )?;
        ::trl_runtime::tp::Parallelize::visit_weights_mut(
            &mut self.o_proj,
            &::trl_runtime::tp::child_name(name, "out"),
            f,
        )?;
        ::trl_runtime::tp::Parallelize::visit_weights_mut(
            &mut self.norm,
            &::trl_runtime::tp::child_name(name, "norm"),
            f,
        )?;
        Ok(())
    }
    fn visit_units(&self, name: &str, f: &mut dyn FnMut(&str)) {
        ::trl_runtime::tp::Parallelize::visit_units(
            &self.norm,
            &::trl_runtime::tp::child_name(name, "norm"),
            f,
        );
    }
}
