//! Legacy PC devices on the PIO bus: a 16550A UART and the i8042 reset line, both on
//! `vm-superio`.

use std::io::{self, Write};

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState as SuperioSerialState;
use vm_superio::{I8042Device, Trigger};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::bus::BusDevice;
use super::irq::IrqLine;

/// Conventional COM1 port base.
pub const SERIAL_PORT_BASE: u64 = 0x3f8;
/// Width of the UART's register window.
pub const SERIAL_PORT_LEN: u64 = 8;
/// Conventional COM1 interrupt.
pub const SERIAL_GSI: u32 = 4;
/// i8042 window: data port 0x60 up to the command port 0x64.
pub const I8042_PORT_BASE: u64 = 0x60;
/// Width of the i8042 window (0x60..=0x64).
pub const I8042_PORT_LEN: u64 = 5;

/// Errors of the legacy devices.
#[derive(Debug, thiserror::Error)]
pub enum LegacyError {
    /// A saved serial state is not loadable (e.g. its input FIFO is over-full).
    #[error("invalid serial state: {0}")]
    InvalidSerialState(String),
    /// Creating an eventfd failed.
    #[error("eventfd: {0}")]
    EventFd(#[from] io::Error),
}

/// Saved registers and pending input of a [`Serial`] (mirrors `vm_superio::SerialState`,
/// which has no serde support).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialState {
    /// Divisor latch low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Bytes received from the host not yet read by the guest.
    pub in_buffer: Vec<u8>,
}

impl From<SuperioSerialState> for SerialState {
    fn from(s: SuperioSerialState) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialState> for SuperioSerialState {
    fn from(s: &SerialState) -> Self {
        SuperioSerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// Output sink of the console.
pub type SerialOut = Box<dyn Write + Send>;

/// 16550A UART (COM1 at PIO 0x3f8, IRQ 4). Guest output goes to the `Write` sink.
pub struct Serial {
    inner: vm_superio::Serial<IrqLine, vm_superio::serial::NoEvents, SerialOut>,
}

impl std::fmt::Debug for Serial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serial")
            .field("gsi", &self.inner.interrupt_evt().gsi())
            .finish()
    }
}

impl Serial {
    /// A fresh UART raising `irq`, writing guest output to `out`.
    pub fn new(irq: IrqLine, out: SerialOut) -> Self {
        Serial {
            inner: vm_superio::Serial::new(irq, out),
        }
    }

    /// Rebuilds a UART from saved state with a new interrupt line and output sink.
    pub fn restore(state: &SerialState, irq: IrqLine, out: SerialOut) -> Result<Self, LegacyError> {
        let inner =
            vm_superio::Serial::from_state(&state.into(), irq, vm_superio::serial::NoEvents, out)
                .map_err(|e| LegacyError::InvalidSerialState(e.to_string()))?;
        Ok(Serial { inner })
    }

    /// Registers and pending input, for a snapshot.
    pub fn state(&self) -> SerialState {
        self.inner.state().into()
    }

    /// Queues host input for the guest to read; returns how many bytes fit in the FIFO.
    pub fn enqueue_input(&mut self, input: &[u8]) -> io::Result<usize> {
        let room = self.inner.fifo_capacity();
        let n = input.len().min(room);
        self.inner
            .enqueue_raw_bytes(&input[..n])
            .map_err(|e| io::Error::other(e.to_string()))
    }

    /// The interrupt line (its eventfd goes to `register_irqfd`).
    pub fn irq(&self) -> &IrqLine {
        self.inner.interrupt_evt()
    }
}

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(first), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.inner.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Some(&value), Ok(off)) = (data.first(), u8::try_from(offset)) {
            if let Err(e) = self.inner.write(off, value) {
                tracing::warn!(error = %e, "serial write failed");
            }
        }
    }
}

/// The reset eventfd as a `vm-superio` trigger.
#[derive(Debug)]
struct ResetEvt(EventFd);

impl Trigger for ResetEvt {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// i8042 controller, emulated only so that the guest can request a reset (`reboot=k` writes
/// 0xFE to port 0x64); that raises [`I8042::reset_evt`], which the VMM's run loop watches.
/// Insert at [`I8042_PORT_BASE`] with [`I8042_PORT_LEN`].
#[derive(Debug)]
pub struct I8042 {
    inner: I8042Device<ResetEvt>,
}

impl I8042 {
    /// A controller with a fresh non-blocking reset eventfd.
    pub fn new() -> Result<Self, LegacyError> {
        Ok(I8042 {
            inner: I8042Device::new(ResetEvt(EventFd::new(EFD_NONBLOCK)?)),
        })
    }

    /// Signalled when the guest asks for a CPU reset.
    pub fn reset_evt(&self) -> &EventFd {
        &self.inner.reset_evt().0
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(first), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.inner.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Some(&value), Ok(off)) = (data.first(), u8::try_from(offset)) {
            if let Err(e) = self.inner.write(off, value) {
                tracing::warn!(error = %e, "i8042 reset eventfd write failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::Bus;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn serial_output_input_interrupt_and_state() {
        let out = Shared::default();
        let irq = IrqLine::new(SERIAL_GSI).unwrap();
        let serial = Arc::new(Mutex::new(Serial::new(
            irq.try_clone().unwrap(),
            Box::new(out.clone()),
        )));
        let mut bus = Bus::new();
        bus.insert(SERIAL_PORT_BASE, SERIAL_PORT_LEN, serial.clone())
            .unwrap();
        for b in b"hi\n" {
            assert!(bus.write(SERIAL_PORT_BASE, &[*b]));
        }
        assert_eq!(&*out.0.lock().unwrap(), b"hi\n");

        // Enable "received data available" interrupts (IER bit 0), then feed input.
        bus.write(SERIAL_PORT_BASE + 1, &[0x01]);
        irq.take_count();
        assert_eq!(serial.lock().unwrap().enqueue_input(b"ab").unwrap(), 2);
        assert!(irq.take_count() > 0, "input must raise the IRQ");
        let mut lsr = [0u8];
        bus.read(SERIAL_PORT_BASE + 5, &mut lsr);
        assert_eq!(lsr[0] & 1, 1, "LSR data-ready");
        let mut c = [0u8];
        bus.read(SERIAL_PORT_BASE, &mut c);
        assert_eq!(c[0], b'a');

        // Snapshot with one byte still pending; the restored UART keeps it and the scratch reg.
        bus.write(SERIAL_PORT_BASE + 7, &[0x5a]);
        let st = serial.lock().unwrap().state();
        assert_eq!(st.in_buffer, b"b");
        let json = serde_json::to_string(&st).unwrap();
        let st2: SerialState = serde_json::from_str(&json).unwrap();
        let mut restored = Serial::restore(
            &st2,
            IrqLine::new(SERIAL_GSI).unwrap(),
            Box::new(io::sink()),
        )
        .unwrap();
        let mut c = [0u8];
        restored.read(0, &mut c);
        assert_eq!(c[0], b'b');
        restored.read(7, &mut c);
        assert_eq!(c[0], 0x5a);

        // An over-full FIFO in a (corrupt) state is an error, not a panic.
        let mut bad = st2.clone();
        bad.in_buffer = vec![0; 100_000];
        assert!(Serial::restore(&bad, IrqLine::new(4).unwrap(), Box::new(io::sink())).is_err());
        // Odd offsets and empty accesses are ignored.
        restored.write(1 << 40, &[1]);
        restored.write(0, &[]);
        restored.read(0, &mut []);
    }

    #[test]
    fn i8042_reset_raises_eventfd() {
        let dev = Arc::new(Mutex::new(I8042::new().unwrap()));
        let mut bus = Bus::new();
        bus.insert(I8042_PORT_BASE, I8042_PORT_LEN, dev.clone())
            .unwrap();
        assert!(
            dev.lock().unwrap().reset_evt().read().is_err(),
            "nothing pending yet"
        );
        bus.write(0x64, &[0xaa]);
        assert!(
            dev.lock().unwrap().reset_evt().read().is_err(),
            "other commands do not reset"
        );
        bus.write(0x64, &[0xfe]);
        assert_eq!(dev.lock().unwrap().reset_evt().read().unwrap(), 1);
        let mut d = [0xffu8];
        assert!(bus.read(0x60, &mut d));
    }
}
