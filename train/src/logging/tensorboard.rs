//! TensorBoard event files: scalars and PNG images in the format TensorBoard's reader (and
//! TensorFlow's `tf.summary`) reads, written without TensorFlow.
//!
//! A file is a sequence of TFRecords: `u64` length (little-endian), its masked CRC-32C, the
//! record, the record's masked CRC-32C. Each record is an `Event` protocol buffer
//! (`tensorflow/core/util/event.proto`): the first holds `file_version = "brain.Event:2"`, the
//! others a `Summary` of tagged values at a step. The few messages needed are encoded here by
//! hand: protobuf's wire format for them is a handful of tagged fields.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Appends events to one `events.out.tfevents.*` file in a log directory.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Create `dir` (and parents) and a new event file in it, named as TensorFlow names them
    /// (`events.out.tfevents.{seconds}.{host}.{pid}`), so that a resumed run adds a file beside
    /// the earlier ones and TensorBoard reads them all, in name order: `seconds` is at least one
    /// more than that of every event file already there (a run resumed within the second it
    /// stopped must still sort after it).
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let existing = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned());
        let seconds = file_seconds(existing, now().trunc() as u64);
        let name = format!(
            "events.out.tfevents.{seconds}.{host}.{}",
            std::process::id()
        );
        let path = dir.join(name);
        let mut writer = Self {
            out: BufWriter::new(File::create(&path)?),
            path,
        };
        let mut event = Message::default();
        event.double(1, now());
        event.bytes(3, b"brain.Event:2");
        writer.record(&event.0)?;
        Ok(writer)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mark a restart at `step`: TensorBoard drops what earlier files logged at `step` and
    /// after (a resumed run repeats the steps after its checkpoint), as for TensorFlow's
    /// `SessionLog.START`.
    pub fn restart(&mut self, step: u64) -> std::io::Result<()> {
        let mut log = Message::default();
        log.varint(1, 1); // status: START
        let mut event = Message::default();
        event.double(1, now());
        event.varint(2, step);
        event.bytes(6, &log.0);
        self.record(&event.0)?;
        self.out.flush()
    }

    /// Scalars `(tag, value)` at `step`, in one event, flushed.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> std::io::Result<()> {
        let mut summary = Message::default();
        for (tag, value) in values {
            let mut v = Message::default();
            v.bytes(1, tag.as_bytes());
            v.float(2, *value as f32);
            summary.bytes(1, &v.0);
        }
        self.summary(step, &summary)
    }

    /// A PNG image (`png`: the encoded file, `width` × `height` pixels, RGB) under `tag` at
    /// `step`, flushed.
    pub fn image(
        &mut self,
        step: u64,
        tag: &str,
        png: &[u8],
        width: u32,
        height: u32,
    ) -> std::io::Result<()> {
        let mut image = Message::default();
        image.varint(1, height as u64);
        image.varint(2, width as u64);
        image.varint(3, 3); // colorspace: RGB
        image.bytes(4, png);
        let mut v = Message::default();
        v.bytes(1, tag.as_bytes());
        v.bytes(4, &image.0);
        let mut summary = Message::default();
        summary.bytes(1, &v.0);
        self.summary(step, &summary)
    }

    fn summary(&mut self, step: u64, summary: &Message) -> std::io::Result<()> {
        let mut event = Message::default();
        event.double(1, now());
        event.varint(2, step);
        event.bytes(5, &summary.0);
        self.record(&event.0)?;
        self.out.flush()
    }

    /// One TFRecord holding `data`.
    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())
    }
}

/// Seconds since the Unix epoch.
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The CRC-32C of `data`, rotated and offset as TFRecord stores it.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// A protocol-buffer message being encoded: fields appended in order.
#[derive(Default)]
struct Message(Vec<u8>);

impl Message {
    fn key(&mut self, field: u32, wire_type: u8) {
        self.raw_varint(((field as u64) << 3) | wire_type as u64);
    }

    fn raw_varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.0.push((value as u8) | 0x80);
            value >>= 7;
        }
        self.0.push(value as u8);
    }

    fn varint(&mut self, field: u32, value: u64) {
        self.key(field, 0);
        self.raw_varint(value);
    }

    fn double(&mut self, field: u32, value: f64) {
        self.key(field, 1);
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn float(&mut self, field: u32, value: f32) {
        self.key(field, 5);
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn bytes(&mut self, field: u32, value: &[u8]) {
        self.key(field, 2);
        self.raw_varint(value.len() as u64);
        self.0.extend_from_slice(value);
    }
}

/// The seconds to name a new event file with at time `now` (seconds) beside the files `names`:
/// later than every event file's among them.
fn file_seconds(names: impl Iterator<Item = String>, now: u64) -> u64 {
    names
        .filter_map(|n| {
            let rest = n.strip_prefix("events.out.tfevents.")?;
            rest.split('.').next()?.parse::<u64>().ok()
        })
        .map(|s| s + 1)
        .fold(now, u64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_fields_encode_as_protobuf() {
        let mut m = Message::default();
        m.varint(2, 300);
        m.bytes(1, b"ab");
        m.float(2, 1.0);
        assert_eq!(
            m.0,
            [0x10, 0xac, 0x02, 0x0a, 0x02, b'a', b'b', 0x15, 0, 0, 0x80, 0x3f]
        );
    }

    #[test]
    fn a_new_event_file_sorts_after_those_there() {
        let names = |v: &[&str]| {
            v.iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert_eq!(file_seconds(names(&[]), 100), 100);
        let there = ["events.out.tfevents.100.vm.999", "loss_curve.png"];
        assert_eq!(file_seconds(names(&there), 100), 101);
        assert_eq!(file_seconds(names(&there), 250), 250);
    }

    #[test]
    fn crc_is_masked_as_tfrecord_does() {
        // tensorboard.summary.writer.record_writer.masked_crc32c(b"123456789").
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }
}
