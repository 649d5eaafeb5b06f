//! An error with its chain of sources, for logs.

/// Formats an error with its chain of sources, for logs.
pub struct DisplayChain<'a, E: std::error::Error>(pub &'a E);

impl<E: std::error::Error> std::fmt::Display for DisplayChain<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut src = self.0.source();
        while let Some(s) = src {
            write!(f, ": {s}")?;
            src = s.source();
        }
        Ok(())
    }
}
