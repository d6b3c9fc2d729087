//! Any text into the TOML configurations flowgate reads (pipeline files, simulation scenarios,
//! tuner settings): parsed or rejected, never a panic. A pipeline file that parses has passed
//! every bound, so its recipe builds (or names a missing feature) without a panic, and a
//! parsed scenario's derived numbers are finite.
#![no_main]

use flowgate::spec::PipelineSpec;
use flowgate::tuner::scenario::Scenario;
use flowgate::TunerSettings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(spec) = PipelineSpec::parse(text, "fuzz.toml") {
        let _ = spec.recipe();
        let _ = spec.tuner_settings();
        let _ = spec.decode_workers();
    }
    if let Ok(s) = toml::from_str::<Scenario>(text) {
        let _ = s.memory_bytes();
        for stage in &s.stages {
            let _ = stage.cost.mean_s();
        }
    }
    let _ = toml::from_str::<TunerSettings>(text);
});
