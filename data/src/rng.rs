//! A small counter-keyed random source, so that every sample's data, noise and noise level
//! depend only on (seed, sample, stream) — not on which rank draws it or in what order.

/// SplitMix64 (Steele, Lea & Flood), seeded from a key.
#[derive(Debug, Clone)]
pub struct KeyedRng {
    state: u64,
}

impl KeyedRng {
    /// The stream for `(seed, index, stream)`.
    pub fn new(seed: u64, index: u64, stream: u64) -> Self {
        let mut rng = Self {
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
        };
        rng.state ^= rng
            .next_u64()
            .wrapping_add(index.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        rng.state ^= rng
            .next_u64()
            .wrapping_add(stream.wrapping_mul(0x94D0_49BB_1331_11EB));
        rng
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `n` standard normals as f32.
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal() as f32).collect()
    }
}
