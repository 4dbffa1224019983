//! Enums whose values are written as names (Accelerate's launch YAML keys and environment
//! variables, TRL's loss types, transformers' schedules): each declared once, with its names,
//! by [`named!`]; parsers read them by name (`yaml::Section::named`, `plan`'s `Vars::named`,
//! [`Named::from_name`]).

/// An enum read and written by name: `NAMES[i]` names `ALL[i]`, the first the default.
pub trait Named: Copy + 'static {
    const NAMES: &'static [&'static str];
    const ALL: &'static [Self];

    /// The value `name` names (exactly as listed); None for a name not listed.
    fn from_name(name: &str) -> Option<Self> {
        let i = Self::NAMES.iter().position(|n| *n == name)?;
        Some(Self::ALL[i])
    }
}

/// Declares each enum with its variants and the name written for each (the first the
/// default): the enum, [`Named`] and `as_str`. Doc comments on the enum and its variants
/// are kept.
macro_rules! named {
    ($($(#[$m:meta])* $t:ident { $($(#[$vm:meta])* $v:ident = $n:literal),+ $(,)? })+) => {$(
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $t {
            $($(#[$vm])* $v),+
        }

        impl $crate::config::named::Named for $t {
            const NAMES: &'static [&'static str] = &[$($n),+];
            const ALL: &'static [Self] = &[$($t::$v),+];
        }

        impl $t {
            pub fn as_str(self) -> &'static str {
                match self {
                    $($t::$v => $n),+
                }
            }
        }
    )+};
}
pub(crate) use named;
