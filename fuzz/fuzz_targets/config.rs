//! Any text into the TOML configurations flowgate reads (simulation scenarios, tuner settings):
//! parsed or rejected, never a panic; a parsed scenario's derived numbers are finite.
#![no_main]

use flowgate::tuner::scenario::Scenario;
use flowgate::TunerSettings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(s) = toml::from_str::<Scenario>(text) {
        let _ = s.memory_bytes();
        for stage in &s.stages {
            let _ = stage.cost.mean_s();
        }
    }
    let _ = toml::from_str::<TunerSettings>(text);
});
