//! One cube-master leads per database: the PostgreSQL advisory lock behind `Lease`.

mod common;

use common::TestDb;
use cube_master::leader::Lease;
use std::time::Duration;

#[tokio::test]
async fn one_master_leads_per_database_and_the_next_takes_over() {
    let Some(db) = TestDb::postgres("leader::one_master_leads::postgres").await else {
        return;
    };
    let poll = Duration::from_millis(50);
    let first = Lease::acquire(&db.url, poll).await.unwrap();
    let url = db.url.clone();
    let second = tokio::spawn(async move { Lease::acquire(&url, poll).await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !second.is_finished(),
        "a second master leads beside the first"
    );
    // Another schema (another fleet in the same database) has a leader of its own.
    let other = TestDb::postgres("leader::other_schema").await.unwrap();
    let o = tokio::time::timeout(Duration::from_secs(5), Lease::acquire(&other.url, poll))
        .await
        .expect("another schema's master is not held back")
        .unwrap();
    drop(o);
    // The leader's session ends (its process died): the standby leads.
    drop(first);
    let l = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("the standby did not take over")
        .unwrap()
        .unwrap();
    assert!(matches!(l, Lease::Pg(_)));
    // SQLite: one master per file, it always leads.
    let s = TestDb::sqlite();
    assert!(matches!(
        Lease::acquire(&s.url, poll).await.unwrap(),
        Lease::Sole
    ));
}
