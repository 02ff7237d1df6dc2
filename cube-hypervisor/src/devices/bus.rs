//! Address-range dispatch of guest PIO/MMIO accesses to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device reachable through a [`Bus`]. `offset` is relative to the base the device was
/// inserted at; `data.len()` is the access width (1, 2, 4 or 8 bytes, little endian).
pub trait BusDevice: Send {
    /// Guest read: fill `data`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Guest write of `data`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Why a device could not be placed on a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// The range `[base, base+len)` has zero length or wraps around the address space.
    #[error("invalid bus range base {base:#x} len {len:#x}")]
    InvalidRange {
        /// Requested base.
        base: u64,
        /// Requested length.
        len: u64,
    },
    /// The range intersects a device already on the bus.
    #[error("bus range {base:#x}+{len:#x} overlaps the device at {other_base:#x}+{other_len:#x}")]
    Overlap {
        /// Requested base.
        base: u64,
        /// Requested length.
        len: u64,
        /// Base of the existing device.
        other_base: u64,
        /// Length of the existing device.
        other_len: u64,
    },
}

struct Entry {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// A set of non-overlapping address ranges, each owned by one device.
#[derive(Default)]
pub struct Bus {
    // Keyed by base address so a lookup is one range query.
    devices: BTreeMap<u64, Entry>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<(u64, u64)> = self.devices.iter().map(|(b, e)| (*b, e.len)).collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Places `device` at `[base, base+len)`. Rejects empty, wrapping and overlapping ranges.
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        device: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        let end = match base.checked_add(len) {
            Some(end) if len > 0 => end,
            _ => return Err(BusError::InvalidRange { base, len }),
        };
        // The only candidates for overlap are the last device starting below `end`.
        if let Some((&other_base, other)) = self.devices.range(..end).next_back() {
            if other_base + other.len > base {
                return Err(BusError::Overlap {
                    base,
                    len,
                    other_base,
                    other_len: other.len,
                });
            }
        }
        self.devices.insert(base, Entry { len, device });
        Ok(())
    }

    fn lookup(&self, addr: u64, access_len: usize) -> Option<(u64, &Arc<Mutex<dyn BusDevice>>)> {
        let (&base, entry) = self.devices.range(..=addr).next_back()?;
        let offset = addr - base;
        // The whole access must fall inside the device's window.
        if offset.checked_add(access_len as u64)? > entry.len {
            return None;
        }
        Some((offset, &entry.device))
    }

    /// Dispatches a guest read. Returns false when no device covers `[addr, addr+data.len())`
    /// (then `data` is left untouched).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.lookup(addr, data.len()) {
            Some((offset, dev)) => {
                // A poisoned lock means a device panicked earlier; keep serving the guest.
                let mut dev = dev.lock().unwrap_or_else(|e| e.into_inner());
                dev.read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a guest write. Returns false when no device covers the range.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.lookup(addr, data.len()) {
            Some((offset, dev)) => {
                let mut dev = dev.lock().unwrap_or_else(|e| e.into_inner());
                dev.write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        writes: Vec<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = offset as u8 + i as u8;
            }
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.writes.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_range_and_rejects_overlaps() {
        let mut bus = Bus::new();
        let a = Arc::new(Mutex::new(Recorder::default()));
        let b = Arc::new(Mutex::new(Recorder::default()));
        bus.insert(0x1000, 0x100, a.clone()).unwrap();
        bus.insert(0x1100, 0x100, b.clone()).unwrap();
        assert!(matches!(
            bus.insert(0x10ff, 2, a.clone()),
            Err(BusError::Overlap {
                other_base: 0x1100,
                ..
            })
        ));
        assert!(matches!(
            bus.insert(0x0f00, 0x101, a.clone()),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(0x1000, 0x300, a.clone()),
            Err(BusError::Overlap { .. })
        ));
        assert_eq!(
            bus.insert(u64::MAX, 2, a.clone()),
            Err(BusError::InvalidRange {
                base: u64::MAX,
                len: 2
            })
        );
        assert!(bus.insert(0x5000, 0, a.clone()).is_err());

        assert!(bus.write(0x1104, &[1, 2]));
        assert_eq!(b.lock().unwrap().writes, vec![(4, vec![1, 2])]);
        assert!(a.lock().unwrap().writes.is_empty());
        let mut d = [0u8; 4];
        assert!(bus.read(0x1010, &mut d));
        assert_eq!(d, [0x10, 0x11, 0x12, 0x13]);
        // Holes and accesses straddling the end of a window reach nobody.
        assert!(!bus.write(0x0fff, &[0]));
        assert!(!bus.write(0x1200, &[0]));
        let mut d = [0u8; 4];
        assert!(!bus.read(0x11fe, &mut d));
        assert_eq!(d, [0; 4]);
    }
}
