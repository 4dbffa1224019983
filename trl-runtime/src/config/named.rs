//! Enums whose values Accelerate writes as names (launch YAML keys, environment variables):
//! each declared once, with its names, by [`named!`]; parsers read them by name
//! (`yaml::Section::named`, `plan`'s `Vars::named`).

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

/// Declares each enum with its variants and the name Accelerate writes for each (the first
/// the default): the enum, [`Named`] and `as_str`.
macro_rules! named {
    ($($t:ident { $($v:ident = $n:literal),+ $(,)? })+) => {$(
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $t {
            $($v),+
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
