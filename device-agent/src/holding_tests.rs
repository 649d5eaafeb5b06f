//! The handover rules of [`super::claim`].

use super::*;
use crate::device::Device;

const S: [u8; 16] = [1; 16];
const D: [u8; 16] = [2; 16];
const C: [u8; 16] = [3; 16];

fn device() -> Arc<Device> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let spec: crate::DeviceSpec = format!("disk0={}", path.display()).parse().unwrap();
    let dev = Device::open(&spec).unwrap();
    // The file stays open; the directory may go.
    std::mem::forget(dir);
    Arc::new(dev)
}

fn ask(borrower: [u8; 16], successor_of: Option<[u8; 16]>, queue: u16) -> Ask<'static> {
    Ask {
        borrower,
        successor_of,
        queue,
        lease: None,
    }
}

fn take(dev: &Arc<Device>, a: Ask<'_>) -> Result<Claim, Refusal> {
    claim(&dev.holding, Qos::default(), &a, None)
}

#[test]
fn one_borrower_at_a_time() {
    let dev = device();
    let s = take(&dev, ask(S, None, 0)).unwrap();
    assert_eq!(take(&dev, ask(C, None, 0)).err(), Some(Refusal::Held(S)));
    assert_eq!(
        take(&dev, ask([0; 16], None, 0)).err(),
        Some(Refusal::Held(S))
    );
    drop(s);
    assert!(!dev.is_held());
    let _c = take(&dev, ask(C, None, 0)).unwrap();
    assert!(dev.held_by(C));
}

#[test]
fn the_successor_stands_by_then_takes_the_device_when_the_holder_lets_go() {
    let dev = device();
    let s_hold = take(&dev, ask(S, None, CONTROL_QUEUE)).unwrap();
    let s_q0 = take(&dev, ask(S, None, 0)).unwrap();
    // The destination's holding session stands by; its queue sessions wait.
    let d_hold = take(&dev, ask(D, Some(S), CONTROL_QUEUE)).unwrap();
    assert!(d_hold.is_standby());
    assert!(dev.held_by(S));
    assert_eq!(
        take(&dev, ask(D, Some(S), 0)).err(),
        Some(Refusal::Waiting { from: S })
    );
    // A third borrower is refused, with or without a handover of its own.
    assert_eq!(take(&dev, ask(C, None, 0)).err(), Some(Refusal::Held(S)));
    assert_eq!(
        take(&dev, ask(C, Some(S), CONTROL_QUEUE)).err(),
        Some(Refusal::HandingOver { from: S, to: D })
    );
    assert_eq!(
        take(&dev, ask(C, Some(D), CONTROL_QUEUE)).err(),
        Some(Refusal::NotHolder { from: D })
    );
    // The source lets go: reserved for the handover, nobody else gets it.
    drop(s_q0);
    drop(s_hold);
    assert!(!dev.is_held());
    assert_eq!(
        take(&dev, ask(C, None, 0)).err(),
        Some(Refusal::HandingOver { from: S, to: D })
    );
    assert_eq!(
        take(&dev, ask([0; 16], None, 0)).err(),
        Some(Refusal::HandingOver { from: S, to: D })
    );
    let d_q0 = take(&dev, ask(D, Some(S), 0)).unwrap();
    assert!(!d_q0.is_standby());
    assert!(dev.held_by(D));
    // Now the source is the other borrower.
    assert_eq!(take(&dev, ask(S, None, 0)).err(), Some(Refusal::Held(D)));
    // The standby session counts as a holding one now: the device stays the
    // destination's while only it is open.
    drop(d_q0);
    assert!(dev.held_by(D));
    drop(d_hold);
    assert!(!dev.is_held());
    let _c = take(&dev, ask(C, None, 0)).unwrap();
}

#[test]
fn a_failed_migration_gives_the_device_back_to_the_source() {
    let dev = device();
    let s_hold = take(&dev, ask(S, None, CONTROL_QUEUE)).unwrap();
    let d_hold = take(&dev, ask(D, Some(S), CONTROL_QUEUE)).unwrap();
    drop(s_hold);
    // The source VM resumes before the destination took the device.
    let s_again = take(&dev, ask(S, None, 0)).unwrap();
    assert!(dev.held_by(S));
    assert_eq!(
        take(&dev, ask(D, Some(S), 0)).err(),
        Some(Refusal::Waiting { from: S })
    );
    // The destination goes: the handover is forgotten.
    drop(d_hold);
    drop(s_again);
    let _c = take(&dev, ask(C, None, 0)).unwrap();
}

#[test]
fn a_destination_that_goes_before_the_switch_leaves_nothing_reserved() {
    let dev = device();
    let s_hold = take(&dev, ask(S, None, CONTROL_QUEUE)).unwrap();
    let d1 = take(&dev, ask(D, Some(S), CONTROL_QUEUE)).unwrap();
    let d2 = take(&dev, ask(D, Some(S), CONTROL_QUEUE)).unwrap();
    drop(d1);
    // One standby session is still open: still designated.
    assert_eq!(
        take(&dev, ask(C, Some(S), CONTROL_QUEUE)).err(),
        Some(Refusal::HandingOver { from: S, to: D })
    );
    drop(d2);
    // A new destination may be designated now.
    let _c = take(&dev, ask(C, Some(S), CONTROL_QUEUE)).unwrap();
    drop(s_hold);
}

#[test]
fn a_lender_restarted_mid_handover_reserves_the_device_for_the_two() {
    // Found by a trial: after a lender restart the destination's holding session came
    // back first, took the free device, and the source VM, still running, got I/O
    // errors.
    let dev = device();
    let d_hold = take(&dev, ask(D, Some(S), CONTROL_QUEUE)).unwrap();
    assert!(d_hold.is_standby());
    assert!(!dev.is_held());
    assert_eq!(
        take(&dev, ask(C, None, 0)).err(),
        Some(Refusal::HandingOver { from: S, to: D })
    );
    // The source comes back and goes on.
    let s_q0 = take(&dev, ask(S, None, 0)).unwrap();
    assert!(dev.held_by(S));
    assert_eq!(
        take(&dev, ask(D, Some(S), 0)).err(),
        Some(Refusal::Waiting { from: S })
    );
    drop(s_q0);
    // Its VM stopped: the destination's VM runs and takes it.
    let _d_q0 = take(&dev, ask(D, Some(S), 0)).unwrap();
    assert!(dev.held_by(D));
    drop(d_hold);
}
