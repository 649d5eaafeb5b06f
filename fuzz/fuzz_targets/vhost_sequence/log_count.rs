//! Log counting: every tracing event and `log` record at INFO or above, so that an
//! iteration's log can be checked to stay bounded.

use super::*;

pub(crate) static LOG_LINES: AtomicUsize = AtomicUsize::new(0);

pub(crate) struct CountingSubscriber;

pub(crate) struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl tracing::Subscriber for CountingSubscriber {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        *m.level() <= tracing::Level::INFO
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::INFO)
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        LOG_LINES.fetch_add(1, Ordering::Relaxed);
        if *SHOW {
            let mut f = Fields(String::new());
            e.record(&mut f);
            eprintln!(
                "  log {} {}:{}",
                e.metadata().level(),
                e.metadata().target(),
                f.0
            );
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

pub(crate) struct CountingLogger;

impl log::Log for CountingLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            LOG_LINES.fetch_add(1, Ordering::Relaxed);
            show!("  log {} {}: {}", r.level(), r.target(), r.args());
        }
    }
    fn flush(&self) {}
}

pub(crate) static LOGGER: CountingLogger = CountingLogger;
