use gpuio::{Backend, Engine};
#[tokio::test(flavor = "multi_thread")]
async fn smoke() {
    for b in [Backend::Uring, Backend::Pread] {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let data: Vec<u8> = (0..10_000_000u32).map(|i| (i * 7 + 3) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let e = Engine::builder().backend(b).chunk_size(1 << 20).bounce_slots(4).build().unwrap();
        println!("{:?}", e.backend());
        let f = e.open(&p).unwrap();
        let mut buf = vec![0u8; 10_000_100];
        let n = f.read_into(&mut buf, 0).await.unwrap();
        assert_eq!(n, data.len());
        assert!(buf[..n] == data[..]);
        let f2 = gpuio::OpenOptions::new().read(true).direct(true).open(&e, &p).unwrap();
        let mut buf = vec![0u8; 5_000_001];
        let n = f2.read_into(&mut buf, 12345).await.unwrap();
        assert_eq!(n, 5_000_001);
        assert!(buf[..] == data[12345..12345 + n]);
        let w = e.create(dir.path().join("g")).unwrap();
        assert_eq!(w.write_from(&data, 3).await.unwrap(), data.len());
        w.sync_all().await.unwrap();
        let back = std::fs::read(dir.path().join("g")).unwrap();
        assert_eq!(&back[3..], &data[..]);
        e.shutdown().await.unwrap();
        assert!(f.read_into(&mut buf, 0).await.is_err());
    }
}
