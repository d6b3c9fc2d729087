//! The budgeted channel's tests (admission, floors, reserves, wakes, epochs).

use super::*;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

fn env(seq: u64, bytes: u64) -> Envelope<u64> {
    Envelope {
        seq,
        bytes,
        reserved: 0,
        item: seq,
        origin: Default::default(),
    }
}

#[test]
fn admits_the_prefix_that_fits_items_and_bytes() {
    let ch = Channel::<u64>::new(3, 100);
    let mut items: Vec<_> = (0..5).map(|i| env(i, 40)).collect();
    assert_eq!(
        ch.acquire_for(&mut items).unwrap(),
        2,
        "80 bytes fit, 120 do not"
    );
    ch.budget().release(1, 40);
    assert_eq!(ch.acquire_for(&mut items[..1]).unwrap(), 1);
    let st = ch.budget().status();
    assert_eq!((st.used_items, st.used_bytes), (2, 80));
}

#[test]
fn an_oversized_item_is_admitted_alone() {
    let b = Budget::new(10, 10);
    assert_eq!(b.acquire([1000u64, 1].into_iter()).unwrap().items, 1);
    b.set_floor(3);
    assert_eq!(
        b.acquire([1000u64, 1000, 5].into_iter()).unwrap().items,
        2,
        "floor of 3 items"
    );
    assert_eq!(b.status().cap_items, 10);
}

#[test]
fn a_blocked_producer_wakes_on_release_and_on_resize() {
    let b = Arc::new(Budget::new(1, u64::MAX));
    assert_eq!(b.acquire([1u64].into_iter()).unwrap().items, 1);
    let b2 = Arc::clone(&b);
    let t = thread::spawn(move || b2.acquire([1u64, 1].into_iter()));
    thread::sleep(Duration::from_millis(20));
    assert!(!t.is_finished());
    b.set_limits(3, u64::MAX);
    assert_eq!(t.join().unwrap().unwrap().items, 2);

    let b2 = Arc::clone(&b);
    let t = thread::spawn(move || b2.acquire([1u64].into_iter()));
    thread::sleep(Duration::from_millis(20));
    b.release(1, 1);
    assert_eq!(t.join().unwrap().unwrap().items, 1);
}

#[test]
fn admission_reserves_for_outputs_and_is_trued_up() {
    let b = Budget::new(100, 1000);
    b.reserve_outputs();
    let a = b.acquire([10u64, 10, 10].into_iter()).unwrap();
    assert_eq!(
        a,
        Admission {
            items: 1,
            reserved: 0
        },
        "cold: the floor only"
    );
    // The first input's outputs took 300 bytes: true it up, learn the reserve.
    b.settle_outputs(300, Some(300));
    let a = b.acquire([10u64, 10, 10].into_iter()).unwrap();
    assert_eq!(
        a,
        Admission {
            items: 2,
            reserved: 300
        },
        "310 + 620 of 1000"
    );
    assert_eq!(b.status().used_bytes, 310 + 620);
    // Smaller outputs than reserved give the difference back.
    b.adjust(-200);
    b.release(1, 10 + 300);
    assert_eq!(b.status().used_bytes, 310 + 620 - 200 - 310);
    b.settle_outputs(0, Some(100));
    assert_eq!(
        b.state.lock().reserve,
        300 - 300 / RESERVE_DECAY,
        "decays, not drops"
    );
}

#[test]
fn close_unblocks_everyone() {
    let b = Arc::new(Budget::new(1, 1));
    b.acquire([1u64].into_iter()).unwrap();
    let b2 = Arc::clone(&b);
    let t = thread::spawn(move || b2.acquire([1u64].into_iter()));
    thread::sleep(Duration::from_millis(10));
    b.close();
    assert_eq!(t.join().unwrap(), Err(Closed));
    assert!(b.status().closed);
}

#[test]
fn finish_is_tied_to_the_epoch() {
    let b = Budget::new(4, 4);
    b.finish(0);
    assert!(b.status().finished);
    b.begin(1);
    b.finish(0);
    assert!(
        !b.status().finished,
        "a late finish of epoch 0 does not end epoch 1"
    );
    b.finish(1);
    assert!(b.status().finished);
}

// The tests below were written for the mutants `cargo mutants` found uncaught in this file
// (scripts/mutants.sh, docs/guarantees.md "Mutation testing").

#[test]
fn an_async_producer_waits_for_room_and_is_admitted_on_release() {
    let b = Arc::new(Budget::new(2, u64::MAX));
    let a = futures::executor::block_on(b.acquire_async([1u64, 1, 1].into_iter())).unwrap();
    assert_eq!(a.items, 2, "the prefix that fits");
    let b2 = Arc::clone(&b);
    let t =
        thread::spawn(move || futures::executor::block_on(b2.acquire_async([1u64].into_iter())));
    thread::sleep(Duration::from_millis(30));
    assert!(
        !t.is_finished(),
        "a full budget admits nothing: the producer waits"
    );
    b.release(1, 1);
    assert_eq!(t.join().unwrap().unwrap().items, 1);
    b.close();
    assert_eq!(
        futures::executor::block_on(b.acquire_async([1u64].into_iter())),
        Err(Closed)
    );
}

#[test]
fn settled_outputs_true_up_the_bytes_both_ways_and_wake_producers() {
    let b = Arc::new(Budget::new(100, 100));
    b.reserve_outputs();
    // Cold: only the floor (one item) is admitted until the reserve is known.
    assert_eq!(b.acquire([10u64, 10].into_iter()).unwrap().items, 1);
    let b2 = Arc::clone(&b);
    let t = thread::spawn(move || b2.acquire([10u64].into_iter()));
    thread::sleep(Duration::from_millis(30));
    assert!(
        !t.is_finished(),
        "cold: a second item waits for the reserve"
    );
    // Learning the reserve (no byte change) wakes the waiting producer.
    b.settle_outputs(0, Some(20));
    assert_eq!(t.join().unwrap().unwrap().items, 1);
    assert_eq!(b.status().used_bytes, 10 + 10 + 20);
    // Outputs larger than reserved charge more; smaller give back.
    b.settle_outputs(15, None);
    assert_eq!(b.status().used_bytes, 55);
    b.settle_outputs(-25, None);
    assert_eq!(b.status().used_bytes, 30);
    // A give-back wakes a producer waiting for bytes.
    b.set_limits(100, 40);
    let b2 = Arc::clone(&b);
    let t = thread::spawn(move || b2.acquire([5u64].into_iter()));
    thread::sleep(Duration::from_millis(30));
    assert!(!t.is_finished(), "30 + 5 + 20 reserved is over 40");
    b.settle_outputs(-20, None);
    assert_eq!(t.join().unwrap().unwrap().items, 1);
}

#[test]
fn adjust_and_charge_move_the_bytes_by_exactly_what_they_say() {
    let b = Budget::new(10, 1000);
    b.acquire([100u64].into_iter()).unwrap();
    b.adjust(50);
    assert_eq!(b.status().used_bytes, 150);
    b.adjust(-30);
    assert_eq!(b.status().used_bytes, 120);
    b.adjust(0);
    assert_eq!(b.status().used_bytes, 120);
    b.charge(7);
    assert_eq!(b.status().used_bytes, 127);
    b.charge(0);
    assert_eq!(b.status().used_bytes, 127);
    b.release(0, 0);
    assert_eq!((b.status().used_items, b.status().used_bytes), (1, 127));
    b.release(1, 127);
    assert_eq!((b.status().used_items, b.status().used_bytes), (0, 0));
    // An item of no bytes (an empty clip) gives its permit back too.
    b.acquire([0u64].into_iter()).unwrap();
    b.release(1, 0);
    assert_eq!((b.status().used_items, b.status().used_bytes), (0, 0));
}

#[test]
fn the_last_release_of_a_finished_epoch_wakes_its_consumers() {
    let b = Budget::new(4, 100);
    b.acquire([1u64, 1].into_iter()).unwrap();
    b.finish(0);
    let l = b.listen_data();
    b.release(1, 1);
    assert!(
        l.wait_timeout(Duration::from_millis(30)).is_none(),
        "an item still held: no wake"
    );
    let l = b.listen_data();
    b.release(1, 1);
    assert!(
        l.wait_timeout(Duration::from_secs(5)).is_some(),
        "the epoch's last item released: consumers wake"
    );
    let l = b.listen_data();
    b.notify_data(1);
    assert!(l.wait_timeout(Duration::from_secs(5)).is_some());
}

#[test]
fn a_channel_is_empty_until_sent_and_after_taken() {
    let ch = Channel::<u64>::new(4, 100);
    assert!(ch.is_empty());
    let mut items = vec![env(0, 1), env(1, 1)];
    assert_eq!(ch.acquire_for(&mut items).unwrap(), 2);
    ch.send(items);
    assert!(!ch.is_empty());
    assert_eq!(ch.try_recv().map(|c| c.len()), Some(2));
    assert!(ch.is_empty());
}
