//! Welch's t-test: is one set of per-tick rates really higher than another?

use statrs::distribution::{ContinuousCDF, StudentsT};

fn mean_var(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let v = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, v)
}

/// One-sided p-value of "mean of `b` > mean of `a`" (small: `b` is really higher).
/// Needs at least two samples in each; returns 1 otherwise.
pub fn p_greater(a: &[f64], b: &[f64]) -> f64 {
    if a.len() < 2 || b.len() < 2 {
        return 1.0;
    }
    let (ma, va) = mean_var(a);
    let (mb, vb) = mean_var(b);
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let se2 = va / na + vb / nb;
    if se2 <= f64::EPSILON * (ma.abs() + mb.abs() + 1.0) {
        // No noise at all (a deterministic run): any difference is real.
        return if mb > ma { 0.0 } else { 1.0 };
    }
    let t = (mb - ma) / se2.sqrt();
    let df = se2 * se2 / ((va / na).powi(2) / (na - 1.0) + (vb / nb).powi(2) / (nb - 1.0));
    match StudentsT::new(0.0, 1.0, df.max(1.0)) {
        Ok(d) => 1.0 - d.cdf(t),
        Err(_) => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separates_real_gains_from_noise() {
        let a = [100.0, 104.0, 96.0, 101.0, 99.0];
        let b = [120.0, 118.0, 123.0, 119.0, 121.0];
        assert!(p_greater(&a, &b) < 0.001);
        assert!(p_greater(&b, &a) > 0.999);
        let c = [101.0, 97.0, 103.0, 99.0, 100.0];
        let p = p_greater(&a, &c);
        assert!(p > 0.2 && p < 0.8, "{p}");
        assert_eq!(p_greater(&[5.0, 5.0], &[6.0, 6.0]), 0.0);
        assert_eq!(p_greater(&[5.0], &[6.0, 6.0]), 1.0);
    }
}
